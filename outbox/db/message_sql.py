"""The core's statements about messages (outbox rows), named for what they do."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from outbox.db.dialect import bound_now, insert_ignoring_conflicts, supports_skip_locked
from outbox.db.sql import Now, limit_parameter, picked_once, state_literal
from outbox.schema import messages, relays
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


def insert_messages(now: Now, ignore_conflicts: str | None = None) -> Any:
    """Insert outbox messages as pending and due now; optionally skip an existing reply_id."""
    if ignore_conflicts is None:
        statement: Any = sa.insert(messages)
    else:
        statement = insert_ignoring_conflicts(messages, ignore_conflicts)
    return statement.values(
        state=MessageState.PENDING.value, attempts=0, fence=0, available_at=now, created_at=now
    )


@functools.cache
def insert_task_replies(dialect_name: str) -> Any:
    """INSERT task replies (one parameter set per row, each binding `now`); built once."""
    return insert_messages(bound_now(dialect_name))


@functools.cache
def insert_one_message(dialect_name: str) -> Any:
    """INSERT one message unless its reply_id exists, RETURNING the row; built once.

    Bind `now` to a manual clock's time, or None for the database's clock.
    """
    return insert_messages(bound_now(dialect_name), ignore_conflicts=dialect_name).returning(
        *messages.c
    )


def select_message(reply_id: str) -> sa.Select[Any]:
    """One message row by reply_id."""
    return sa.select(messages).where(messages.c.reply_id == reply_id)


def select_messages(state: str | None, limit: int | None) -> sa.Select[Any]:
    """Messages in sequence order, optionally of one state."""
    query = sa.select(messages).order_by(messages.c.id)
    if state is not None:
        query = query.where(messages.c.state == state)
    if limit is not None:
        query = query.limit(limit)
    return query


def unrouted(now: Now) -> sa.Select[int, float]:
    """How many pending messages no live relay delivers, and the age of the oldest.

    A relay announces its destinations in outbox_relays until its announcement
    expires; a destination no live announcement names is unrouted.
    """
    # NOT IN over the (few) live destinations: PostgreSQL hashes them once and SQLite
    # builds one ephemeral index, instead of a correlated probe per pending row.
    routed = sa.select(relays.c.destination).where(relays.c.expires_at > now)
    return sa.select(sa.func.count(), now - sa.func.min(messages.c.created_at)).where(
        messages.c.state == MessageState.PENDING.value, messages.c.destination.not_in(routed)
    )
