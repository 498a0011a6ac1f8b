"""The statements behind `outbox console`'s task and reply pages and its charts, in portable
Core (the dead list and the decisions are `outbox dead`'s own: operations; the audit page's
are `audit`'s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import state_literal
from outbox.drivers.common.audit import audit_rows
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.console_interface import Series
from outbox.drivers.records import AuditedPage
from outbox.schema import messages, requeues, tasks
from outbox.states import MessageState

TASK_FIELDS = (
    tasks.c.task_id,
    tasks.c.tenant_id,
    tasks.c.payload,
    tasks.c.priority,
    tasks.c.state,
    tasks.c.attempts,
    tasks.c.max_attempts,
    tasks.c.owner,
    tasks.c.fence,
    tasks.c.deadline,
    tasks.c.available_at,
    tasks.c.lease_until,
    tasks.c.hops,
    tasks.c.result,
    tasks.c.last_error,
    tasks.c.cancel_requested_at,
    tasks.c.created_at,
    tasks.c.finished_at,
)
"""What the task page shows."""


def select_task(task_id: str) -> sa.Select[Any]:
    """One task, by its primary key."""
    return sa.select(*TASK_FIELDS).where(tasks.c.task_id == task_id)


def select_reply_of(task_id: str) -> sa.Select[Any]:
    """The reply a task wrote (at most one: uq_outbox_messages_task_id)."""
    return sa.select(messages.c.reply_id, messages.c.state).where(messages.c.task_id == task_id)


def select_decisions(reply_id: str) -> sa.Select[Any]:
    """Every audited decision about one message, oldest first (ix_outbox_requeues_reply_id)."""
    return sa.select(requeues).where(requeues.c.reply_id == reply_id).order_by(requeues.c.id)


def message_exists(reply_id: str) -> sa.Select[Any]:
    """Whether a message has this reply_id (its unique index)."""
    return sa.select(messages.c.id).where(messages.c.reply_id == reply_id)


MINUTE = 60.0
CHARTED = {
    "enqueued": (messages.c.created_at, None),
    "sent": (messages.c.sent_at, messages.c.state == state_literal(MessageState.SENT)),
    "dead": (messages.c.available_at, messages.c.state == state_literal(MessageState.DEAD)),
    "finished": (tasks.c.finished_at, tasks.c.finished_at.is_not(None)),
}
"""What the charts count per minute: the timestamp, and the rows its partial index holds
(states written into the SQL, so that a generic plan can still prove the index usable)."""

PER_DESTINATION: frozenset[Series] = frozenset({"enqueued", "sent", "dead"})
"""The series a destination narrows: tasks have none."""

Floor = Callable[[sa.ColumnElement[Any]], sa.ColumnElement[int]]


def per_minute(
    series: Series, since: float, until: float, floor: Floor, destination: str | None = None
) -> sa.Select[int, int]:
    """(minute, count) of one charted series for the minutes in [since, until), of one
    destination's messages if given: only that window is read, through the timestamp's
    index (schema: ix_outbox_*_created/sent/...), the destination a filter on it."""
    stamp, rows = CHARTED[series]
    since_: sa.BindParameter[float] = sa.bindparam("since", since, type_=sa.Double())
    until_: sa.BindParameter[float] = sa.bindparam("until", until, type_=sa.Double())
    minute = floor(stamp / MINUTE)
    window = [stamp >= since_, stamp < until_, *([] if rows is None else [rows])]
    if destination is not None:
        if series not in PER_DESTINATION:
            raise ValueError(f"{series} has no destination")
        window.append(messages.c.destination == destination)
    counted = sa.select(minute.label("minute"), sa.func.count().label("count"))
    return counted.where(*window).group_by(minute)


def dead_since(since: float) -> sa.Select[Any]:
    """(destination, count) of the messages dead since `since`, by when their last attempt
    fell due: only that window is read, through ix_outbox_messages_died."""
    died = messages.c.available_at >= sa.bindparam("since", since, type_=sa.Double())
    dead = messages.c.state == state_literal(MessageState.DEAD)
    counted = sa.select(messages.c.destination, sa.func.count())
    return counted.where(died, dead).group_by(messages.c.destination)


class ConsoleStatements(DriverPieces):
    """A task and its reply, a message's decisions, and the charts' per-minute counts."""

    def task(self, conn: Connection, task_id: str) -> dict[str, Any] | None:
        """One task, as the task page shows it, or None."""
        row = conn.execute(select_task(task_id)).mappings().first()
        return None if row is None else dict(row)

    def reply_of(self, conn: Connection, task_id: str) -> dict[str, Any] | None:
        """The reply_id and state of the reply a task wrote, or None."""
        row = conn.execute(select_reply_of(task_id)).mappings().first()
        return None if row is None else dict(row)

    def decisions(self, conn: Connection, reply_id: str) -> list[dict[str, Any]]:
        """Every audited decision about one message, oldest first."""
        return [dict(row) for row in conn.execute(select_decisions(reply_id)).mappings()]

    def audit_page(self, conn: Connection, page: AuditedPage) -> list[dict[str, Any]]:
        """Up to `page.limit` decisions of each kind `page` asks for, each kind's before its
        own id, merged newest first: the first `page.limit` are the newest of all."""
        return audit_rows(conn, page)

    def message_exists(self, conn: Connection, reply_id: str) -> bool:
        """Whether a message has this reply_id."""
        return conn.execute(message_exists(reply_id)).first() is not None

    def per_minute(
        self,
        conn: Connection,
        series: Series,
        since: float,
        until: float,
        destination: str | None = None,
    ) -> dict[int, int]:
        """The count of each minute (epoch minute number) of one series in [since, until),
        of one destination's messages if given."""
        query = per_minute(series, since, until, self.floor, destination)
        return {int(minute): int(count) for minute, count in conn.execute(query)}

    def dead_since(self, conn: Connection, since: float) -> dict[str, int]:
        """Messages per destination that went dead (their last attempt due) since `since`."""
        return {name: int(count) for name, count in conn.execute(dead_since(since))}
