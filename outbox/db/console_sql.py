"""The statements behind `outbox console`'s task and reply pages (the dead list and the
decisions are `outbox dead`'s own, in outbox.db.operations_sql)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from outbox.schema import messages, requeues, tasks

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
