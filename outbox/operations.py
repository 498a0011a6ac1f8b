"""Operating a running outbox: counts per state, dead replies, purging old sent replies.

Read-mostly queries for the `outbox status`, `outbox dead` and `outbox purge`
commands. Ages are measured against the database's clock (or a manual clock in
tests), never the operator's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox._handle import DatabaseHandle
from outbox.clock import Clock, now_expression
from outbox.schema import MESSAGE_STATES, TASK_STATES, messages, tasks

PURGE_BATCH = 1000
DEAD_FIELDS = (
    messages.c.reply_id,
    messages.c.destination,
    messages.c.task_id,
    messages.c.attempts,
    messages.c.last_status,
    messages.c.last_error,
    messages.c.created_at,
)


class Operations(DatabaseHandle):
    """Status, dead replies and purges on one outbox database."""

    def __init__(self, url_or_engine: str | sa.URL | Engine, clock: Clock | None = None) -> None:
        """Open the database (its schema must be current)."""
        self.clock = clock
        self._open(url_or_engine)

    def _now(self) -> sa.ColumnElement[float]:
        return now_expression(self.clock, self._dialect)

    def status(self) -> dict[str, Any]:
        """Counts per state of tasks and replies, the oldest pending of each, the dead count."""
        with self._engine.connect() as conn:
            task_counts = _counts(conn, tasks.c.state, TASK_STATES)
            reply_counts = _counts(conn, messages.c.state, MESSAGE_STATES)
            oldest_task = _oldest_age(conn, tasks, self._now())
            oldest_reply = _oldest_age(conn, messages, self._now())
        return {
            "tasks": task_counts,
            "replies": reply_counts,
            "oldest_pending_task_age": oldest_task,
            "oldest_pending_reply_age": oldest_reply,
            "dead": reply_counts["dead"],
        }

    def dead(self, limit: int = 100) -> list[dict[str, Any]]:
        """Dead replies, oldest first: why each died and after how many attempts."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        query = (
            sa.select(*DEAD_FIELDS)
            .where(messages.c.state == "dead")
            .order_by(messages.c.id)
            .limit(limit)
        )
        with self._engine.connect() as conn:
            return [dict(row) for row in conn.execute(query).mappings()]

    def reply(self, reply_id: str) -> dict[str, Any] | None:
        """One reply's delivery record (state, attempts, last status and error), or None."""
        query = sa.select(
            *DEAD_FIELDS,
            messages.c.state,
            messages.c.ordering_key,
            messages.c.sent_at,
            sa.func.length(messages.c.body).label("body_bytes"),
        ).where(messages.c.reply_id == reply_id)
        with self._engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        return None if row is None else dict(row)

    def purge_sent(
        self,
        older_than: float,
        batch: int = PURGE_BATCH,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete replies sent more than `older_than` seconds ago, `batch` rows per transaction.

        Returns how many were deleted; `progress` is told the running total after
        each batch. Short transactions keep the relays and writers moving meanwhile.
        """
        if not older_than >= 0:
            raise ValueError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        removed = 0
        while True:
            with self._engine.begin() as conn:
                cutoff = self._now() - older_than
                oldest = (
                    sa.select(messages.c.id)
                    .where(messages.c.state == "sent", messages.c.sent_at < cutoff)
                    .order_by(messages.c.id)
                    .limit(batch)
                )
                ids = list(conn.execute(oldest).scalars())
                if ids:
                    conn.execute(messages.delete().where(messages.c.id.in_(ids)))
            removed += len(ids)
            if progress is not None and ids:
                progress(removed)
            if len(ids) < batch:
                return removed


def _counts(conn: sa.Connection, state: sa.Column[str], states: tuple[str, ...]) -> dict[str, int]:
    """Rows per state, every known state listed (zero when absent)."""
    rows = conn.execute(sa.select(state, sa.func.count()).group_by(state))
    found = {name: int(count) for name, count in rows}
    return {name: found.get(name, 0) for name in states}


def _oldest_age(conn: sa.Connection, table: sa.Table, now: sa.ColumnElement[float]) -> float | None:
    """Seconds since the oldest pending row of `table` was created, or None."""
    age = conn.execute(
        sa.select(now - sa.func.min(table.c.created_at)).where(table.c.state == "pending")
    ).scalar_one()
    return None if age is None else round(float(age), 3)
