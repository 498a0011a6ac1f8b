"""The core's statements about messages that are not behind the driver yet.

The relay's reap of expired delivery leases and the task path's writes and reads of
replies move with the relay's claim, settle and reap and with the task statements;
publish() and the other reads of messages are the drivers' (outbox.drivers).
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from outbox.db.dialect import bound_now, supports_skip_locked
from outbox.db.sql import limit_parameter, picked_once, state_literal
from outbox.drivers.common.messages import message_values
from outbox.schema import messages
from outbox.states import MessageState


@functools.cache
def reap_expired_message_leases(dialect_name: str) -> sa.Update:
    """Return up to :limit messages whose delivery lease expired to pending; the relay then
    decides their fate."""
    now = bound_now(dialect_name)
    pick = messages.alias("pick")
    chosen = (
        sa.select(pick.c.id)
        .where(pick.c.state == state_literal(MessageState.SENDING), pick.c.lease_until <= now)
        .limit(limit_parameter())
    )
    return (
        sa.update(messages)
        .where(
            messages.c.id.in_(picked_once(chosen, supports_skip_locked(dialect_name))),
            messages.c.state == state_literal(MessageState.SENDING),
        )
        .values(
            state=MessageState.PENDING.value,
            lease_until=None,
            available_at=now,
            last_error="lease expired",
        )
        .returning(messages.c.id)
    )


@functools.cache
def insert_task_replies(dialect_name: str) -> Any:
    """INSERT task replies (one parameter set per row, each binding `now`); built once."""
    return message_values(sa.insert(messages), bound_now(dialect_name))


def select_messages(state: str | None, limit: int | None) -> sa.Select[Any]:
    """Messages in sequence order, optionally of one state."""
    query = sa.select(messages).order_by(messages.c.id)
    if state is not None:
        query = query.where(messages.c.state == state)
    if limit is not None:
        query = query.limit(limit)
    return query
