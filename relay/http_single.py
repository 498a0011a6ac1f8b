"""HTTP single: one Standard Webhooks POST per message to the destination's url."""

from __future__ import annotations

from collections.abc import Sequence

from relay.policy import Outcome, Retry, classify
from relay.records import Message
from relay.transport import HttpTransport, Parcel
from relay.webhooks import post, request_headers, snippet


class HttpSingleTransport(HttpTransport):
    """Each message its own signed request; the status decides its outcome."""

    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """One parcel per message."""
        return [Parcel((message,)) for message in messages]

    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """POST the message with its own headers and the signature headers."""
        (message,) = parcel.messages
        destination = self.destination
        headers = {
            **message.headers,
            **request_headers(destination, message.reply_id, message.body),
        }
        response = await post(self.client, destination, destination.url, headers, message.body)
        if isinstance(response, Retry):
            return {message.id: response}
        retry_after = response.headers.get("retry-after")
        return {message.id: classify(response.status, retry_after, snippet(response))}
