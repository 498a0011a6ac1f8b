"""Failed delivery attempts: recorded where their outcome is, read for a reply's timeline,
deleted with their message.

An attempt that did not end in a delivery (a retry, a death, a lease that expired
mid-send) is a row of outbox_failed_attempts. After the settle or the reap that records
it, the message row holds that attempt's outcome (its count, state, status and error), so
the attempt rows are read from it, in the same transaction. PostgreSQL writes them in the
recording statement itself (outbox.drivers.postgresql's settle and reap).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import Settlement
from outbox.schema import failed_attempts, messages
from outbox.states import MessageState

LEASE_EXPIRED = "lease expired"
"""The error of an attempt whose lease expired before its outcome was recorded."""
RECORDED = ("message_id", "attempt", "state", "status", "error", "attempted_at")
"""The columns a recording writes, in the order its SELECT gives them."""


def failed(row: Settlement) -> bool:
    """Whether a settled outcome is a failed attempt: dead, or pending again after an
    attempt (a message left unattempted, whose count is refunded, made none)."""
    return row.state == MessageState.DEAD or (row.state == MessageState.PENDING and not row.refund)


def record_settled(ids: Sequence[int], now: sa.ColumnElement[float]) -> sa.Insert:
    """The failed attempts of messages just settled, each as its row now says."""
    return sa.insert(failed_attempts).from_select(
        RECORDED,
        sa.select(
            messages.c.id,
            messages.c.attempts,
            messages.c.state,
            messages.c.last_status,
            messages.c.last_error,
            now,
        ).where(messages.c.id.in_(list(ids))),
    )


def record_expired(ids: Sequence[int], now: sa.ColumnElement[float]) -> sa.Insert:
    """The attempts of messages just reaped, whose leases expired: no status, no answer."""
    return sa.insert(failed_attempts).from_select(
        RECORDED,
        sa.select(
            messages.c.id,
            messages.c.attempts,
            sa.literal(MessageState.PENDING.value, sa.String()),
            sa.null(),
            sa.literal(LEASE_EXPIRED, sa.String()),
            now,
        ).where(messages.c.id.in_(list(ids))),
    )


def select_failed_attempts(message_id: int, limit: int) -> sa.Select[Any]:
    """A message's newest `limit` failed attempts, newest first (its index, walked back)."""
    return (
        sa.select(failed_attempts)
        .where(failed_attempts.c.message_id == message_id)
        .order_by(failed_attempts.c.id.desc())
        .limit(limit)
    )


def delete_failed_attempts(message_ids: Sequence[int]) -> sa.Delete:
    """The failed attempts of messages being deleted."""
    return failed_attempts.delete().where(failed_attempts.c.message_id.in_(list(message_ids)))


def record_settled_failures(
    conn: Connection, rows: Sequence[Settlement], settled: set[int], now: Now, database_now: str
) -> None:
    """Record the failed attempts among `rows` whose settle changed them (`settled`), in
    the settle's transaction, at `now` (None: `database_now`, the backend's clock in SQL):
    nothing more when every one was delivered."""
    ids = [row.id for row in rows if row.id in settled and failed(row)]
    if ids:
        moment: sa.ColumnElement[float] = (
            sa.literal_column(database_now, sa.Double())
            if now is None
            else sa.literal(float(now), sa.Double())
        )
        conn.execute(record_settled(ids, moment))


class FailedAttemptReads(DriverPieces):
    """A message's failed attempts, for its timeline."""

    def failed_attempts(
        self, conn: Connection, message_id: int, limit: int
    ) -> list[dict[str, Any]]:
        """A message's newest `limit` failed attempts, the oldest of them first."""
        rows = conn.execute(select_failed_attempts(message_id, limit)).mappings()
        return [dict(row) for row in rows][::-1]
