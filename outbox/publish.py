"""publish(): add an outbox message inside the caller's own transaction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from outbox.canonical import MAX_BYTES
from outbox.clock import Clock
from outbox.db.caller import caller_connection
from outbox.errors import InvalidMessage
from outbox.messages import (
    TASK_REPLY_PREFIX,
    add_message,
    check_destination,
    check_headers,
    check_ordering_key,
    check_reply_id,
    check_traceparent,
    encode_body,
)
from outbox.trace_context import TRACEPARENT, TRACESTATE, active_context


def publish(
    session: Session | Connection,
    destination: str,
    reply_id: str,
    body: Any,
    ordering_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    clock: Clock | None = None,
    traceparent: str | None = None,
) -> dict[str, Any]:
    """Add a message to the caller's transaction (never commits); same id and body is a no-op.

    `session` is a Session or a Connection; for an AsyncSession or AsyncConnection,
    `await outbox.asyncio.publish(...)`. The message's creation context (W3C Trace
    Context) is stored with it and sent as headers on every delivery, so the receiver's
    trace joins the publisher's: `traceparent` when given (or a `traceparent` among
    `headers`), else the active OpenTelemetry span's traceparent and tracestate.
    """
    conn = caller_connection(
        session, "outbox.publish", "await outbox.asyncio.publish(session, ...)"
    )
    destination = check_destination(destination)
    reply_id = check_reply_id(reply_id)
    if reply_id.startswith(TASK_REPLY_PREFIX):
        # Taking a task's reply id would make that task's terminal write fail forever.
        raise InvalidMessage(f"reply_id prefix {TASK_REPLY_PREFIX!r} is reserved for task replies")
    ordering_key = check_ordering_key(ordering_key)
    if traceparent is not None:
        headers = {**(headers or {}), TRACEPARENT: check_traceparent(traceparent)}
    header_json = check_headers(headers, creation_context(headers))
    data = encode_body(body, MAX_BYTES)
    return add_message(
        conn,
        reply_id=reply_id,
        destination=destination,
        body=data,
        ordering_key=ordering_key,
        headers=header_json,
        now=None if clock is None else float(clock()),
    )


def creation_context(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The active span's trace context, unless the caller's headers carry trace context."""
    # Runs before check_headers: headers of any shape reach it, and that check refuses them.
    if isinstance(headers, Mapping) and any(
        isinstance(name, str) and name.lower() in (TRACEPARENT, TRACESTATE) for name in headers
    ):
        return {}
    return active_context()
