"""publish() for asyncio services: the same rules, inside the caller's AsyncSession or
AsyncConnection transaction.

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

from outbox.clock import Clock
from outbox.publish import publish as sync_publish


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
    given: object = session  # checked at run time: callers are not always type-checked
    if isinstance(given, Session | Connection):
        raise TypeError(
            f"outbox.asyncio.publish takes an AsyncSession or AsyncConnection, not a "
            f"{type(given).__name__}: call outbox.publish(session, ...) instead"
        )
    if not isinstance(given, AsyncSession | AsyncConnection):
        raise TypeError(
            f"outbox.asyncio.publish takes an AsyncSession or AsyncConnection, not "
            f"{type(given).__name__}"
        )

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
