"""publish(), receive_tx() and finish_tx() for asyncio services: the same rules, inside
the caller's AsyncSession or AsyncConnection transaction.

Mirrors ``sqlalchemy.ext.asyncio``: the row is written through SQLAlchemy's own
``run_sync`` bridge on the caller's connection, so it joins the caller's transaction
(never commits) on any async driver (asyncpg, psycopg's async mode, aiosqlite).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox.claim import Claim
from outbox.clock import Clock
from outbox.intake import Ack, AuthContext, Envelope
from outbox.publish import publish as sync_publish
from outbox.tasks import TaskQueue


async def publish(
    session: AsyncSession | AsyncConnection,
    destination: str,
    reply_id: str,
    body: Any,
    ordering_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    clock: Clock | None = None,
    traceparent: str | None = None,
) -> dict[str, Any]:
    """Add a message to the caller's async transaction (never commits); see outbox.publish."""
    _require_async(session, "outbox.asyncio.publish", "outbox.publish(session, ...)")

    def write(sync: Session | Connection) -> dict[str, Any]:
        return sync_publish(
            sync,
            destination,
            reply_id,
            body,
            ordering_key=ordering_key,
            headers=headers,
            clock=clock,
            traceparent=traceparent,
        )

    return await session.run_sync(write)


async def receive_tx(
    queue: TaskQueue,
    session: AsyncSession | AsyncConnection,
    auth: AuthContext,
    envelope: Envelope,
) -> Ack:
    """TaskQueue.receive_tx in the caller's async transaction: the same rules; never commits."""
    _require_async(
        session, "outbox.asyncio.receive_tx", "queue.receive_tx(session, auth, envelope)"
    )

    def write(sync: Session | Connection) -> Ack:
        return queue.receive_tx(sync, auth, envelope)

    return await session.run_sync(write)


async def finish_tx(
    queue: TaskQueue, session: AsyncSession | AsyncConnection, claim: Claim, result: Any
) -> None:
    """Write `done`, the result and its reply in the caller's async transaction, fenced
    as TaskQueue.finish_tx is (Fenced when the claim no longer holds); never commits."""
    _require_async(session, "outbox.asyncio.finish_tx", "queue.finish_tx(session, claim, result)")

    def write(sync: Session | Connection) -> None:
        conn = sync if isinstance(sync, Connection) else sync.connection()
        queue.finish_in(conn, claim, result)

    await session.run_sync(write)


def _require_async(session: object, function: str, sync_call: str) -> None:
    """TypeError unless `session` is async; a sync one is pointed at `sync_call`."""
    if isinstance(session, AsyncSession | AsyncConnection):
        return
    instead = f": call {sync_call} instead" if isinstance(session, Session | Connection) else ""
    raise TypeError(
        f"{function} takes an AsyncSession or AsyncConnection, not "
        f"{type(session).__name__}{instead}"
    )
