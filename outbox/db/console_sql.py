"""The statements behind `outbox console`'s task and reply pages (the dead list and the
decisions are `outbox dead`'s own, in outbox.db.operations_sql)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from outbox.db.sql import state_literal
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


def per_minute(series: str, since: float, until: float, dialect_name: str) -> sa.Select[int, int]:
    """(minute, count) of one charted series for the minutes in [since, until): only that
    window is read, through the timestamp's index (schema: ix_outbox_*_created/sent/...)."""
    stamp, rows = CHARTED[series]
    since_: sa.BindParameter[float] = sa.bindparam("since", since, type_=sa.Double())
    until_: sa.BindParameter[float] = sa.bindparam("until", until, type_=sa.Double())
    minute = _floor(stamp / MINUTE, dialect_name)
    window = [stamp >= since_, stamp < until_, *([] if rows is None else [rows])]
    counted = sa.select(minute.label("minute"), sa.func.count().label("count"))
    return counted.where(*window).group_by(minute)


def _floor(value: sa.ColumnElement[Any], dialect_name: str) -> sa.ColumnElement[int]:
    """The whole number at or below a positive `value` (SQLite may lack floor())."""
    if dialect_name == "postgresql":
        return sa.cast(sa.func.floor(value), sa.BigInteger())
    return sa.cast(value, sa.Integer())  # truncates, which is floor for positive values
