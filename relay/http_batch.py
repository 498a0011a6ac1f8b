"""HTTP batch: many messages in one signed POST, each settled by the per-item answer.

The body is `{"replies": [{"reply_id": str, "body": str, "headers": {...}}, ...]}`,
each body the exact stored text of one message, `headers` its stored headers (left
out when it has none), and the request signed with a `batch:` id; the answer is
`{"results": [{"reply_id", "status"}]}` with stored, duplicate, conflict or invalid
per item.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from json.encoder import encode_basestring

from outbox.messages import BATCH_ID_PREFIX
from relay.http_client import Response
from relay.policy import Dead, Outcome, Retry, Sent, classify, truncate
from relay.records import Message
from relay.transport import HttpTransport, Parcel
from relay.webhooks import post, request_headers, snippet

_BATCH_HEAD = b'{"replies":['
_BATCH_TAIL = b"]}"


def pack_batches(
    messages: Sequence[Message], max_items: int, max_bytes: int
) -> list[tuple[list[Message], bytes]]:
    """Split messages into batch bodies within the destination's item and byte limits."""
    packed: list[tuple[list[Message], bytes]] = []
    group: list[Message] = []
    items: list[bytes] = []
    size = len(_BATCH_HEAD) + len(_BATCH_TAIL)
    for message in messages:
        # The body is canonical JSON text, carried as a JSON string; the C string encoder
        # is several times faster than dumping a dict per item.
        item = (
            '{"reply_id":'
            + encode_basestring(message.reply_id)
            + ',"body":'
            + encode_basestring(message.body.decode("utf-8"))
            # A message's own headers (its traceparent among them) travel with it, as
            # they do as HTTP headers in single mode.
            + (',"headers":' + json.dumps(dict(message.headers)) if message.headers else "")
            + "}"
        ).encode()
        if group and (len(group) >= max_items or size + len(item) + 1 > max_bytes):
            packed.append((group, _BATCH_HEAD + b",".join(items) + _BATCH_TAIL))
            group, items, size = [], [], len(_BATCH_HEAD) + len(_BATCH_TAIL)
        group.append(message)
        items.append(item)
        size += len(item) + 1
    if group:
        packed.append((group, _BATCH_HEAD + b",".join(items) + _BATCH_TAIL))
    return packed


class HttpBatchTransport(HttpTransport):
    """Batches within max_batch_items and max_batch_bytes, POSTed to the batch url."""

    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """Messages packed into batch bodies."""
        destination = self.destination
        packed = pack_batches(messages, destination.max_batch_items, destination.max_batch_bytes)
        return [Parcel(group, body) for group, body in packed]

    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """POST one batch; settle each message by the receiver's per-item answer."""
        batch, body = parcel.messages, parcel.body
        assert body is not None, "a batch parcel carries its body"
        destination = self.destination
        batch_id = f"{BATCH_ID_PREFIX}{batch[0].id}-{batch[-1].id}-{len(batch)}"
        headers = request_headers(destination, batch_id, body)
        response = await post(self.client, destination, destination.post_batch_url, headers, body)
        if isinstance(response, Retry):
            return dict.fromkeys((m.id for m in batch), response)
        whole = classify(response.status, response.headers.get("retry-after"), snippet(response))
        if isinstance(whole, Dead) and len(batch) > 1 and response.status in (400, 413):
            # The request as a whole was refused, not each message: a smaller batch may pass.
            whole = Retry(
                whole.status,
                truncate(f"{whole.error} (whole batch of {len(batch)} refused: lower max_batch_*)"),
            )
        if not isinstance(whole, Sent):
            return dict.fromkeys((m.id for m in batch), whole)
        return _per_item(response, batch)


def _per_item(response: Response, batch: Sequence[Message]) -> dict[int, Outcome]:
    try:
        answers = {
            str(item["reply_id"]): str(item["status"]) for item in response.json()["results"]
        }
    except (ValueError, KeyError, TypeError):
        bad = Retry(response.status, "batch answer is not the expected JSON")
        return dict.fromkeys((m.id for m in batch), bad)
    status = response.status
    # One outcome object per kind of answer: a batch's items mostly share one.
    by_answer: dict[str | None, Outcome] = {
        "stored": Sent(status),
        "duplicate": Sent(status),
        "conflict": Dead(409, "conflict: the destination holds this reply_id with another body"),
        "invalid": Dead(400, "invalid: the destination refused this body"),
    }
    omitted = Retry(status, "batch answer omits this message")
    return {message.id: by_answer.get(answers.get(message.reply_id), omitted) for message in batch}
