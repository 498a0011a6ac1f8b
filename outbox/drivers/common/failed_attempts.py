"""Failed delivery attempts: recorded where their outcome is, read for a reply's timeline,
deleted with their message.

An attempt that did not end in a delivery (a retry, a death, a lease that expired
mid-send) is a row of outbox_failed_attempts, written in the transaction that records
its outcome (on PostgreSQL, by the same statement: its settle and reap). The relay names
a turn's failed attempts with their answers (FailedAttempt): a message given back
unattempted makes none, and a retry whose message a receipt lookup then settled keeps
the answer the attempt had. A reaped lease's attempt is read from its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import FailedAttempt
from outbox.schema import failed_attempts, messages
from outbox.states import MessageState

LEASE_EXPIRED = "lease expired"
"""The error of an attempt whose lease expired before its outcome was recorded."""
RECORDED = ("message_id", "attempt", "state", "status", "error", "attempted_at")
"""The columns a recording writes, in the order its SELECT gives them."""


def expired_attempt(message_id: Any, attempts: Any, now: Any) -> sa.Select[Any]:
    """The RECORDED columns of an attempt whose lease expired: pending again, no status,
    the error LEASE_EXPIRED."""
    return sa.select(
        message_id,
        attempts,
        sa.literal(MessageState.PENDING.value, sa.String()),
        sa.null(),
        sa.literal(LEASE_EXPIRED, sa.String()),
        now,
    )


def record_expired(ids: Sequence[int], now: sa.ColumnElement[float]) -> sa.Insert:
    """The attempts of messages just reaped, whose leases expired: no status, no answer."""
    expired = expired_attempt(messages.c.id, messages.c.attempts, now)
    return sa.insert(failed_attempts).from_select(
        RECORDED, expired.where(messages.c.id.in_(list(ids)))
    )


def select_failed_attempts(message_id: int, limit: int, since: float) -> sa.Select[Any]:
    """A message's newest `limit` failed attempts made since `since` (its creation), newest
    first (its index, walked back)."""
    # Rows of an earlier message under the same id (deleted by plain SQL or by a purge of
    # an older version, which left its attempts; SQLite reuses the highest deleted id)
    # are older than this message: they are not its.
    return (
        sa.select(failed_attempts)
        .where(
            failed_attempts.c.message_id == message_id,
            failed_attempts.c.attempted_at >= sa.bindparam("since", since, type_=sa.Double()),
        )
        .order_by(failed_attempts.c.id.desc())
        .limit(limit)
    )


def delete_failed_attempts(message_ids: Sequence[int]) -> sa.Delete:
    """The failed attempts of messages being deleted."""
    return failed_attempts.delete().where(failed_attempts.c.message_id.in_(list(message_ids)))


def record_settled_failures(
    conn: Connection,
    failures: Sequence[FailedAttempt],
    settled: set[int],
    now: Now,
    database_now: str,
) -> None:
    """Record the turn's failed attempts of the messages its settle changed (`settled`),
    in the settle's transaction, at `now` (None: `database_now`, the backend's clock in
    SQL): nothing more when the turn had none."""
    rows = [failure._asdict() for failure in failures if failure.message_id in settled]
    if not rows:
        return
    if now is None:
        # Read once and bound: an expression in the VALUES makes PyMySQL send a statement
        # per row, each holding the settle's row locks longer.
        clock: sa.ColumnElement[float] = sa.literal_column(database_now, sa.Double())
        now = float(conn.execute(sa.select(clock)).scalar_one())
    conn.execute(sa.insert(failed_attempts), [{**row, "attempted_at": now} for row in rows])


class FailedAttemptReads(DriverPieces):
    """A message's failed attempts, for its timeline."""

    def failed_attempts(
        self, conn: Connection, message_id: int, limit: int, since: float
    ) -> list[dict[str, Any]]:
        """A message's newest `limit` failed attempts made since `since` (its creation),
        the oldest of them first."""
        rows = conn.execute(select_failed_attempts(message_id, limit, since)).mappings()
        return [dict(row) for row in rows][::-1]
