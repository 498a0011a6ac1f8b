"""Rows the driver conformance suite (tests/drivers) starts from, written in plain Core."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from outbox.canonical import sha256_hex
from outbox.drivers import Driver
from outbox.schema import messages, relays, tasks

START = 1_000_000.0


def message_row(reply_id: str, body: bytes = b'{"n":1}', **extra: Any) -> dict[str, Any]:
    """The row publish() hands the driver for one message."""
    row = {
        "reply_id": reply_id,
        "task_id": None,
        "destination": "orders",
        "ordering_key": None,
        "body": body,
        "content_hash": sha256_hex(body),
        "headers": "{}",
    }
    return row | extra


def published(driver: Driver, conn: sa.Connection, reply_id: str, now: float, **extra: Any) -> int:
    """Publish one message through the driver at `now`; its id."""
    row = driver.insert_message(conn, message_row(reply_id, **extra), now)
    assert row is not None
    return int(row["id"])


def set_state(conn: sa.Connection, reply_id: str, **values: Any) -> None:
    """Put a message in the state a test starts from, written in plain Core."""
    conn.execute(messages.update().where(messages.c.reply_id == reply_id).values(**values))


def state_of(conn: sa.Connection, reply_id: str) -> dict[str, Any] | None:
    """A message row as stored, read in plain Core."""
    row = conn.execute(sa.select(messages).where(messages.c.reply_id == reply_id)).mappings()
    found = row.first()
    return None if found is None else dict(found)


def add_task(conn: sa.Connection, task_id: str, state: str, created_at: float) -> None:
    """A task row as intake would write it (task statements are not behind the driver yet)."""
    conn.execute(
        tasks.insert().values(
            task_id=task_id,
            tenant_id="agent-a",
            payload='{"job":1}',
            priority=0,
            deadline=created_at + 3600,
            hops=0,
            state=state,
            attempts=0,
            max_attempts=3,
            available_at=created_at,
            fence=0,
            created_at=created_at,
            updated_at=created_at,
            finished_at=None if state == "pending" else created_at + 1,
        )
    )


def announce(conn: sa.Connection, destination: str, expires_at: float) -> None:
    """A relay's announcement that it delivers `destination` until `expires_at`."""
    conn.execute(
        relays.insert().values(owner="relay-1", destination=destination, expires_at=expires_at)
    )
