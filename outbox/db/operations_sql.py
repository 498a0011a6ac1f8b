"""The statements behind `outbox status`, `outbox dead` (list, show, requeue, resolve) and
`outbox purge`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from outbox.db.sql import Now, state_literal
from outbox.schema import messages, requeues
from outbox.states import MessageState, TaskState


@dataclass(frozen=True)
class DeadFilter:
    """Which dead messages: by destination, last status, error text, and age in seconds."""

    destination: str | None = None
    status: int | None = None
    error: str | None = None
    """Text the last error contains (case-insensitive)."""
    newer_than: float | None = None
    older_than: float | None = None
    after: int | None = None
    """Only those after this message id (the next page of a list, which is in id order)."""


DEAD_FIELDS = (
    messages.c.reply_id,
    messages.c.destination,
    messages.c.task_id,
    messages.c.attempts,
    messages.c.last_status,
    messages.c.last_error,
    messages.c.created_at,
    messages.c.content_hash,
)
"""What `outbox dead list` shows of each dead message (and a requeue's receipt lookup needs)."""


def count_by_state(state: sa.Column[str]) -> sa.Select[str, int]:
    """Rows per value of a table's `state` column."""
    return sa.select(state, sa.func.count()).group_by(state)


def oldest_pending_age(table: sa.Table, now: Now) -> sa.Select[Any]:
    """Seconds since the oldest pending row of `table` was created (NULL when none)."""
    return sa.select(now - sa.func.min(table.c.created_at)).where(
        table.c.state == TaskState.PENDING.value
    )


def select_dead(limit: int, now: Now, chosen: DeadFilter) -> sa.Select[Any]:
    """Dead messages that match `chosen`, oldest first, each with its id and age."""
    # The state written into the SQL: a generic plan can then use ix_outbox_messages_dead.
    query = sa.select(
        messages.c.id, *DEAD_FIELDS, (now - messages.c.created_at).label("age")
    ).where(messages.c.state == state_literal(MessageState.DEAD))
    if chosen.destination is not None:
        query = query.where(messages.c.destination == chosen.destination)
    if chosen.status is not None:
        query = query.where(messages.c.last_status == chosen.status)
    if chosen.error is not None:
        query = query.where(messages.c.last_error.icontains(chosen.error, autoescape=True))
    if chosen.newer_than is not None:
        query = query.where(messages.c.created_at > now - chosen.newer_than)
    if chosen.older_than is not None:
        query = query.where(messages.c.created_at <= now - chosen.older_than)
    if chosen.after is not None:
        query = query.where(messages.c.id > chosen.after)
    return query.order_by(messages.c.id).limit(limit)


def select_delivery_record(reply_id: str) -> sa.Select[Any]:
    """One message's delivery record: state, attempts, last status and error, body size."""
    return sa.select(
        *DEAD_FIELDS,
        messages.c.state,
        messages.c.ordering_key,
        messages.c.sent_at,
        messages.c.body,
        sa.func.length(messages.c.body).label("body_bytes"),
    ).where(messages.c.reply_id == reply_id)


def select_dead_to_requeue(reply_id: str) -> sa.Select[Any]:
    """The id and last outcome of a dead message, to requeue it."""
    return sa.select(
        messages.c.id, messages.c.attempts, messages.c.last_status, messages.c.last_error
    ).where(messages.c.reply_id == reply_id, messages.c.state == MessageState.DEAD.value)


def requeue_dead(message_id: int, now: Now) -> sa.Update:
    """A dead message pending again with a fresh budget; guarded by its state."""
    # Of two operators requeueing at once, one changes the row.
    return (
        messages.update()
        .where(messages.c.id == message_id, messages.c.state == MessageState.DEAD.value)
        .values(
            state=MessageState.PENDING.value,
            attempts=0,
            available_at=now,
            owner=None,
            lease_until=None,
            last_status=None,
            last_error=None,
        )
    )


def resolve_dead(reply_id: str, now: Now) -> sa.Update:
    """A dead message resolved, never to be delivered; guarded by its state. Returns the
    outcome it keeps (attempts, last status and error), or no row when it was not dead."""
    # One statement both checks and changes: of a resolve and a requeue (or two resolves)
    # at once, one changes the row and the other's guard no longer matches it.
    return (
        messages.update()
        .where(messages.c.reply_id == reply_id, messages.c.state == MessageState.DEAD.value)
        .values(state=MessageState.RESOLVED.value, resolved_at=now)
        .returning(messages.c.attempts, messages.c.last_status, messages.c.last_error)
    )


def select_state(reply_id: str) -> sa.Select[Any]:
    """One message's state, to say why a decision found nothing to change."""
    return sa.select(messages.c.state).where(messages.c.reply_id == reply_id)


def insert_decision_audit(**values: Any) -> Any:
    """One audit row of a decision about a dead message (`outbox_requeues`), returned whole."""
    return requeues.insert().values(**values).returning(*requeues.c)


def select_purgeable(cutoff: Now, batch: int) -> sa.Select[Any]:
    """The ids and states of up to `batch` messages sent, or resolved, before `cutoff`, oldest
    first."""
    return (
        sa.select(messages.c.id, messages.c.state)
        .where(
            sa.or_(
                sa.and_(messages.c.state == MessageState.SENT.value, messages.c.sent_at < cutoff),
                sa.and_(
                    messages.c.state == MessageState.RESOLVED.value,
                    messages.c.resolved_at < cutoff,
                ),
            )
        )
        .order_by(messages.c.id)
        .limit(batch)
    )


def delete_messages(ids: Sequence[int]) -> sa.Delete:
    """Delete messages by id."""
    return messages.delete().where(messages.c.id.in_(list(ids)))
