"""HTTP delivery: one signed POST per reply, or one signed POST per batch.

Every attempt sends the stored body bytes unchanged with the same reply_id.
Each attempt is bounded as a whole (see relay.http). Errors kept for
operators never include headers or secrets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring
from typing import Literal, NamedTuple

from outbox.signing import sign
from relay.config import Destination
from relay.http import HttpClient, Response, TransportError
from relay.policy import Dead, Outcome, Retry, Sent, classify, truncate

USER_AGENT = "outbox-relay/0.1"
BATCH_ID_PREFIX = "batch:"


class Message(NamedTuple):
    """A claimed message: what to send and the lease it was claimed under."""

    id: int
    reply_id: str
    destination: str
    body: bytes
    content_hash: str
    headers: Mapping[str, str]
    attempts: int
    fence: int


def _request_headers(destination: Destination, msg_id: str, body: bytes) -> dict[str, str]:
    headers = {"content-type": "application/json", "user-agent": USER_AGENT}
    if destination.secret is not None:
        headers.update(sign(destination.secret, msg_id, None, body))
    else:
        headers["webhook-id"] = msg_id
    return headers


async def _post(
    client: HttpClient, destination: Destination, url: str, headers: Mapping[str, str], body: bytes
) -> Response | Retry:
    try:
        return await client.request(
            "POST", url, headers=headers, body=body, seconds=destination.timeout
        )
    except TimeoutError:
        return Retry(None, f"attempt exceeded {destination.timeout:g}s")
    except TransportError as exc:
        return Retry(None, truncate(str(exc)))


async def post_one(client: HttpClient, destination: Destination, message: Message) -> Outcome:
    """POST one reply with Standard Webhooks headers; classify the answer."""
    headers = {**message.headers, **_request_headers(destination, message.reply_id, message.body)}
    response = await _post(client, destination, destination.url, headers, message.body)
    if isinstance(response, Retry):
        return response
    return classify(response.status, response.headers.get("retry-after"), _snippet(response))


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


_BATCH_HEAD = b'{"replies":['
_BATCH_TAIL = b"]}"


async def post_batch(
    client: HttpClient, destination: Destination, batch: Sequence[Message], body: bytes
) -> dict[int, Outcome]:
    """POST many replies in one signed request; settle each by the receiver's per-item answer."""
    batch_id = f"{BATCH_ID_PREFIX}{batch[0].id}-{batch[-1].id}-{len(batch)}"
    headers = _request_headers(destination, batch_id, body)
    response = await _post(client, destination, destination.post_batch_url, headers, body)
    if isinstance(response, Retry):
        return dict.fromkeys((m.id for m in batch), response)
    whole = classify(response.status, response.headers.get("retry-after"), _snippet(response))
    if isinstance(whole, Dead) and len(batch) > 1 and response.status in (400, 413):
        # The request as a whole was refused, not each reply: a smaller batch may pass.
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
    omitted = Retry(status, "batch answer omits this reply")
    return {message.id: by_answer.get(answers.get(message.reply_id), omitted) for message in batch}


Receipt = Literal["held", "other body", "absent"]
"""What a destination's receipt lookup says of a reply; None when it did not answer."""


async def receipt_matches(
    client: HttpClient, destination: Destination, reply_id: str, content_hash: str
) -> bool | None:
    """Ask the destination whether it holds this exact reply: True, False, or None (unknown)."""
    answer = await lookup_receipt(client, destination, reply_id, content_hash)
    return None if answer is None else answer == "held"


async def lookup_receipt(
    client: HttpClient, destination: Destination, reply_id: str, content_hash: str
) -> Receipt | None:
    """The destination's receipt of `reply_id`: this body, another body, none; None: no answer."""
    headers = _request_headers(destination, reply_id, b"")
    url = destination.lookup_url(reply_id)
    try:
        response = await client.request("GET", url, headers=headers, seconds=destination.timeout)
    except (TimeoutError, TransportError):
        return None
    if response.status == 404:
        return "absent"
    if response.status != 200:
        return None
    try:
        held = response.json().get("content_hash")
    except (ValueError, AttributeError):
        return None
    return "held" if held == content_hash else "other body"


def ask_receipt(destination: Destination, reply_id: str, content_hash: str) -> Receipt | None:
    """lookup_receipt for command-line tools: blocking, on a client of its own."""

    async def ask() -> Receipt | None:
        client = HttpClient(1)
        try:
            return await lookup_receipt(client, destination, reply_id, content_hash)
        finally:
            await client.close()

    return asyncio.run(ask())


def _snippet(response: Response) -> str:
    if 200 <= response.status < 300:
        return ""
    return truncate(response.text(), 200)
