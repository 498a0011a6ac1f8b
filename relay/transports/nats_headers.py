"""The headers of one message published to JetStream, with their block, built from a template.

A message carries `Nats-Msg-Id` (first: nats-server takes the first one),
`Nats-Expected-Stream`, then the broker headers (relay.transports.broker_headers). A signed
destination's `Nats-Msg-Id` is derived from the reply_id with its secret
(outbox.signing.broker_message_id): a publisher without the secret cannot take a
reply's id first and have the stream drop the reply as a duplicate. An unsigned
destination's is the reply_id itself.
Most of the block is the same for every message of a destination: the template
holds it encoded, and each message adds its id, timestamp, signature and hash
(values the relay produced or checked itself) and its own headers. A message
whose own headers share a name with the relay's, or a value header_lines would
change, is built through the general path (`general`); both give the same
headers and the same bytes (tests/relay/test_nats_headers.py).
"""

from __future__ import annotations

from outbox.signing import (
    CONTENT_HASH_HEADER,
    ID_HEADER,
    ORDERING_KEY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    broker_message_id,
    is_webhook_id,
    signature,
)
from relay.destination import Destination
from relay.records import Message
from relay.transports.broker_headers import broker_headers
from relay.transports.nats_wire import STATUS_LINE, HeaderBlock, header_lines, sent_as_is
from relay.webhooks import FIXED_HEADERS

MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"


class NatsHeaders:
    """Builds each message's HeaderBlock for one destination publishing to `stream`."""

    def __init__(self, destination: Destination, stream: str) -> None:
        """Encode what every message of the destination says alike, once."""
        self.destination = destination
        self.stream = stream
        self._key = destination.signing_key
        self._after_id = "\r\n" + header_lines({EXPECTED_STREAM_HEADER: stream})
        self._fixed = header_lines(FIXED_HEADERS)
        self._relay_names = frozenset(
            {MSG_ID_HEADER, EXPECTED_STREAM_HEADER, *FIXED_HEADERS}
            | {ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER, CONTENT_HASH_HEADER}
            | {ORDERING_KEY_HEADER}
        )

    def build(self, message: Message, seconds: int) -> HeaderBlock:
        """The message's headers and block, signed at `seconds`; BadHeaderName when one of
        its own header names is not a NATS one, and ValueError, TypeError or AttributeError
        for a row no publish() stores (as the general path raises them)."""
        reply_id, content_hash, own = message.reply_id, message.content_hash, message.headers
        ordering_key = message.ordering_key
        key = self._key
        if (
            not sent_as_is(content_hash)
            or (ordering_key is not None and not sent_as_is(ordering_key))
            or not (is_webhook_id(reply_id) if key is not None else sent_as_is(reply_id))
            or (own and not self._relay_names.isdisjoint(own))
            # broker_headers drops an ordering-key header of the message's own, any case.
            or (own and any(name.lower() == ORDERING_KEY_HEADER for name in own))
        ):
            return self.general(message, seconds)
        msg_id = reply_id if key is None else broker_message_id(key, reply_id)
        headers = {MSG_ID_HEADER: msg_id, EXPECTED_STREAM_HEADER: self.stream, **own}
        headers.update(FIXED_HEADERS)
        headers[ID_HEADER] = reply_id
        if key is None:
            signed = ""
        else:
            headers[TIMESTAMP_HEADER] = stamp = str(seconds)
            headers[SIGNATURE_HEADER] = mac = signature(key, reply_id, seconds, message.body)
            signed = f"{TIMESTAMP_HEADER}: {stamp}\r\n{SIGNATURE_HEADER}: {mac}\r\n"
        headers[CONTENT_HASH_HEADER] = content_hash
        keyed = ""
        if ordering_key is not None:
            headers[ORDERING_KEY_HEADER] = ordering_key
            keyed = f"{ORDERING_KEY_HEADER}: {ordering_key}\r\n"
        block = (
            f"{STATUS_LINE}{MSG_ID_HEADER}: {msg_id}{self._after_id}"
            f"{header_lines(own) if own else ''}{self._fixed}{ID_HEADER}: {reply_id}\r\n"
            f"{signed}{CONTENT_HASH_HEADER}: {content_hash}\r\n{keyed}\r\n"
        )
        return HeaderBlock(headers, block.encode())

    def general(self, message: Message, seconds: int) -> HeaderBlock:
        """The message's headers and block built and encoded header by header."""
        key = self._key
        reply_id = message.reply_id
        return HeaderBlock(
            {
                MSG_ID_HEADER: reply_id if key is None else broker_message_id(key, reply_id),
                EXPECTED_STREAM_HEADER: self.stream,
                **broker_headers(self.destination, message, seconds),
            }
        )
