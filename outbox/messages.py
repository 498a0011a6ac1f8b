"""Outbox messages: their validation, their bodies, and writing them in a transaction."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox.canonical import NotCanonical, canonical_bytes, sha256_hex
from outbox.db.dialect import is_missing_table
from outbox.drivers import driver_for
from outbox.errors import InvalidMessage, PayloadCollision, SchemaNotReady
from outbox.reserved_headers import reservation_of
from outbox.states import ErrorCode

# Signed as "id.timestamp.body": a '.' in the id would make that string ambiguous.
REPLY_ID = re.compile(r"[\x21-\x2d\x2f-\x7e]{1,200}")
DESTINATION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,199}")
ORDERING_KEY = re.compile(r"[\x20-\x7e]{1,200}")
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+^_`|~.-]{1,100}")
MAX_HEADER_VALUE = 4096
# Headers ride with every attempt of the message (and in every batch item): a few small
# ones, not a second body.
MAX_HEADERS = 32
MAX_HEADERS_BYTES = 16 * 1024
# Task replies are "reply:" + task_id; publish() may not take ids from that namespace.
TASK_REPLY_PREFIX = "reply:"
# A string as JSON text, with an encoder built once rather than by json.dumps at each call.
_JSON_TEXT = json.JSONEncoder(ensure_ascii=False)
# A batch request is signed with a "batch:" id, which no message may take: a captured
# batch request then cannot pass as one message at a receiver, nor the reverse.
BATCH_ID_PREFIX = "batch:"
# Reply_ids joined by spaces, which no reply_id holds: a whole batch's in one regex pass.
_ONE_OF_REPLY_IDS = f"(?!{re.escape(BATCH_ID_PREFIX)}){REPLY_ID.pattern}"
REPLY_IDS = re.compile(f"{_ONE_OF_REPLY_IDS}(?: {_ONE_OF_REPLY_IDS})*")


def is_reply_id(text: object) -> bool:
    """Whether `text` may identify a message (see check_reply_id)."""
    return (
        isinstance(text, str)
        and REPLY_ID.fullmatch(text) is not None
        and not text.startswith(BATCH_ID_PREFIX)
    )


def are_reply_ids(texts: Sequence[object]) -> bool:
    """Whether every one of `texts` may identify a message (is_reply_id), in one pass."""
    if not texts or not all(type(text) is str for text in texts):
        return all(is_reply_id(text) for text in texts)
    joined = " ".join(texts)  # type: ignore[arg-type]
    # A space inside one of them would pass for a separator: then each is asked alone.
    if joined.count(" ") != len(texts) - 1:
        return False
    return REPLY_IDS.fullmatch(joined) is not None


def check_reply_id(reply_id: object) -> str:
    """A reply_id: 1..200 printable ASCII characters, no whitespace, control characters or '.',
    not starting with the batch requests' prefix."""
    if not is_reply_id(reply_id):
        raise InvalidMessage(
            f"reply_id must be 1..200 printable ASCII characters without whitespace or '.', "
            f"not starting with {BATCH_ID_PREFIX!r}, got {reply_id!r:.80}"
        )
    assert isinstance(reply_id, str)
    return reply_id


def check_destination(destination: object) -> str:
    """A destination NAME (letters, digits, '_' and '-'), resolved to a URL by relay config."""
    if not isinstance(destination, str) or not DESTINATION.fullmatch(destination):
        raise InvalidMessage(
            f"destination must be a configured name of letters, digits, '_' or '-' "
            f"(never a URL), got {destination!r:.80}"
        )
    return destination


def check_ordering_key(key: object) -> str | None:
    """An optional ordering key: 1..200 printable ASCII characters."""
    if key is None:
        return None
    if not isinstance(key, str) or not ORDERING_KEY.fullmatch(key):
        raise InvalidMessage(
            f"ordering_key must be 1..200 printable ASCII characters, got {key!r:.80}"
        )
    return key


# W3C Trace Context: version-traceid-parentid-flags, lowercase hex; all-zero ids are invalid.
TRACEPARENT = re.compile(
    r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
)


def check_traceparent(value: object) -> str:
    """A W3C `traceparent` header value."""
    if not isinstance(value, str) or not TRACEPARENT.fullmatch(value):
        raise InvalidMessage(f"traceparent is not a W3C trace context value: {value!r:.80}")
    return value


def check_headers(
    headers: Mapping[str, str] | None, trace_context: Mapping[str, str] | None = None
) -> str:
    """Extra HTTP headers to send, as canonical JSON; reserved names refused (reserved_headers).

    At most MAX_HEADERS headers of MAX_HEADERS_BYTES in all (names and values). They are
    not part of a message's identity: publishing the same reply_id and body again with
    other headers is a no-op that keeps the first ones. `trace_context` (the active
    span's, outbox.trace_context) is added after the checks, outside the caller's budget:
    tracing on must not make a publish that passes without it fail.
    """
    if headers is None:
        return _header_json({}, trace_context)
    if not isinstance(headers, Mapping):
        raise InvalidMessage("headers must be a mapping of str to str")
    if len(headers) > MAX_HEADERS:
        raise InvalidMessage(f"at most {MAX_HEADERS} headers, got {len(headers)}")
    for name, value in headers.items():
        if not isinstance(name, str) or not HEADER_NAME.fullmatch(name):
            raise InvalidMessage(f"invalid header name {name!r:.80}")
        reservation = reservation_of(name)
        if reservation is not None:
            raise InvalidMessage(reservation.refuse(name))
        if (
            not isinstance(value, str)
            or len(value) > MAX_HEADER_VALUE
            or not re.fullmatch(r"[\x20-\x7e\t]*", value)
        ):
            raise InvalidMessage(f"invalid value for header {name!r}")
    size = sum(len(name) + len(value) for name, value in headers.items())
    if size > MAX_HEADERS_BYTES:
        raise InvalidMessage(f"headers hold {size} bytes, more than {MAX_HEADERS_BYTES}")
    return _header_json(headers, trace_context)


def _header_json(headers: Mapping[str, str], trace_context: Mapping[str, str] | None) -> str:
    """Headers and a creation context as canonical JSON."""
    merged = dict(headers) if not trace_context else {**headers, **trace_context}
    return json.dumps(merged, sort_keys=True, separators=(",", ":"))


def encode_body(body: object, max_bytes: int) -> bytes:
    """The exact bytes that will be sent: canonical JSON of a JSON-safe body."""
    try:
        return canonical_bytes(body, max_bytes=max_bytes)
    except NotCanonical as exc:
        raise InvalidMessage(f"body: {exc}") from exc


class ReplyError(NamedTuple):
    """Why a task ended other than `done`, as its reply's `error` object says."""

    code: ErrorCode
    reason: str


class TaskReply(NamedTuple):
    """What one task's terminal reply says: its status, and its result or its error."""

    task_id: str
    status: str
    result_json: str | None = None
    error: ReplyError | None = None
    creation: Mapping[str, str] | None = None
    """The reply's creation context: the trace context of the run that answered."""


def task_reply_body(reply: TaskReply) -> bytes:
    """The one terminal reply of a task; identical bytes whatever retry writes it.

    A result comes as canonical JSON, checked within the result's limits when it was
    encoded (task_results.prepare): it is spliced in as it is, in its key's place.
    Decoding and encoding it again inside the body cost a busy worker a tenth of its
    time, and counted the body's own level of nesting against the result's limits, so
    a result at the limit was accepted and then failed every write of its reply.
    """
    if reply.result_json is not None and reply.error is None:
        status = _JSON_TEXT.encode(str(reply.status))
        task_id = _JSON_TEXT.encode(reply.task_id)
        body_text = (
            f'{{"kind":"result","result":{reply.result_json},"status":{status},'
            f'"task_id":{task_id}}}'
        )
        return body_text.encode("utf-8")
    result = None if reply.result_json is None else json.loads(reply.result_json)
    body: dict[str, Any] = {
        "kind": "result",
        "task_id": reply.task_id,
        "status": reply.status,
        "result": result,
    }
    if reply.error is not None:
        body["error"] = {"code": str(reply.error.code), "reason": reply.error.reason}
    return canonical_bytes(body, max_bytes=None)


def task_reply_rows(replies: Sequence[TaskReply], destination: str) -> list[dict[str, Any]]:
    """The outbox rows of each task reply, bodies encoded."""
    rows = []
    for reply in replies:
        body = task_reply_body(reply)
        rows.append(
            {
                "reply_id": TASK_REPLY_PREFIX + reply.task_id,
                "task_id": reply.task_id,
                "destination": destination,
                "ordering_key": None,
                "body": body,
                "content_hash": sha256_hex(body),
                "headers": _header_json({}, reply.creation) if reply.creation else "{}",
            }
        )
    return rows


def add_task_replies(
    conn: Connection,
    replies: Sequence[TaskReply],
    destination: str,
    now: float | None,
) -> None:
    """Insert each task reply; joins the caller's transaction.

    `now` is a manual clock's time, or None for the database's clock.
    """
    if not replies:
        return
    driver_for(conn).insert_task_replies(conn, task_reply_rows(replies, destination), now)


def add_message(
    conn: Connection,
    *,
    reply_id: str,
    destination: str,
    body: bytes,
    ordering_key: str | None,
    headers: str,
    now: float | None,
) -> dict[str, Any]:
    """Insert a message unless this reply_id and body exist; joins the caller's transaction.

    `now` is a manual clock's time, or None for the database's clock.
    """
    digest = sha256_hex(body)
    row = {
        "reply_id": reply_id,
        "task_id": None,
        "destination": destination,
        "ordering_key": ordering_key,
        "body": body,
        "content_hash": digest,
        "headers": headers,
    }
    driver = driver_for(conn)
    try:
        inserted = driver.insert_message(conn, row, now)
    except sa.exc.DBAPIError as exc:
        if is_missing_table(exc):
            url = conn.engine.url.render_as_string(hide_password=True)
            raise SchemaNotReady(
                f"database {url} has no outbox tables. Run: outbox db upgrade --db {url}"
            ) from exc
        raise
    if inserted is not None:
        return message_dict(inserted)
    existing = driver.message(conn, reply_id)
    if existing is None:
        raise sa.exc.NoResultFound(f"reply_id {reply_id!r} was held, and is gone")
    if (
        existing["content_hash"] != digest
        or existing["destination"] != destination
        or existing["ordering_key"] != ordering_key
    ):
        raise PayloadCollision(
            f"reply_id {reply_id!r} is stored for {existing['destination']!r} with content hash "
            f"{existing['content_hash']}; this one is for {destination!r} with {digest}"
        )
    return message_dict(existing)


def message_dict(row: RowMapping) -> dict[str, Any]:
    """A message row as a plain dict, body as the exact bytes and headers decoded."""
    result = dict(row)
    result["body"] = bytes(result["body"])
    result["headers"] = json.loads(result["headers"])
    return result
