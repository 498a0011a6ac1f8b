"""The headers of a message delivered into a broker: what an HTTP delivery says, and more.

A broker message carries the stored body bytes unchanged and, as headers, the
message's own headers (the traceparent among them), the Standard Webhooks id
(the reply_id), timestamp and signature made with the destination's secret
exactly as for HTTP, and the body's content hash. A consumer verifies the
signature to know the message came from this outbox, and dedupes by
(reply_id, content hash) as the reference receiver does. A message with an ordering
key carries it too (outbox-ordering-key). The broker's own message id is set by each
transport: AMQP message_id is the reply_id; Nats-Msg-Id, which the stream dedupes by,
is derived from it with the secret (relay.transports.nats_headers).
"""

from __future__ import annotations

from outbox.signing import CONTENT_HASH_HEADER, ORDERING_KEY_HEADER
from relay.destination import Destination
from relay.records import Message
from relay.webhooks import request_headers


def broker_headers(
    destination: Destination, message: Message, timestamp: float | None = None
) -> dict[str, str]:
    """The headers one broker message carries (see the module's docstring), signed at
    `timestamp` (by default now: a parcel's messages may share one reading of the clock)."""
    headers = request_headers(destination, message.reply_id, message.body, timestamp)
    headers[CONTENT_HASH_HEADER] = message.content_hash
    if message.ordering_key is not None:
        headers[ORDERING_KEY_HEADER] = message.ordering_key
    if message.headers:
        # The message's own headers first, as HTTP sends them; the relay's win a clash.
        # An ordering-key header of its own (stored before publish() refused one) is
        # dropped: a message without a key must not reach a consumer as keyed.
        own = {
            name: value
            for name, value in message.headers.items()
            if name.lower() != ORDERING_KEY_HEADER
        }
        return {**own, **headers}
    return headers
