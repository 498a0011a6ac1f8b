"""What the demo reads back to check its invariants: named queries on both databases.

Each opens its own short-lived engine (or uses the queue's), reads, and returns
plain data; the demo prints and checks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa

import outbox
from outbox.receiver_tables import effects, receipts
from outbox.schema import messages, tasks
from outbox.states import MessageState


@contextlib.contextmanager
def reading(url: str) -> Iterator[sa.Connection]:
    """A connection to `url` on an engine of its own, disposed afterwards."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def tables_in_use(url: str) -> list[str]:
    """The outbox tables of `url` that already hold rows."""
    with reading(url) as conn:
        return [
            table.name
            for table in (tasks, messages)
            if conn.execute(sa.select(sa.literal(1)).select_from(table).limit(1)).first()
        ]


def task_held_by(engine: sa.Engine, owner: str) -> dict[str, Any]:
    """The first task `owner` took of those it holds: its id, owner, fence and state.

    A worker may hold the next task too: it takes one while a result commits.
    """
    query = (
        sa.select(tasks.c.task_id, tasks.c.owner, tasks.c.fence, tasks.c.state)
        .where(tasks.c.owner == owner)
        .order_by(tasks.c.created_at, tasks.c.task_id)
        .limit(1)
    )
    with engine.connect() as conn:
        return dict(conn.execute(query).mappings().one())


def messages_of(engine: sa.Engine, task_ids: Sequence[str], reply_id: str) -> list[Any]:
    """(reply_id, task_id) of the tasks' replies and of one published message."""
    query = sa.select(messages.c.reply_id, messages.c.task_id).where(
        messages.c.task_id.in_(list(task_ids)) | (messages.c.reply_id == reply_id)
    )
    with engine.connect() as conn:
        return list(conn.execute(query).all())


def receipt_hashes(receiver_url: str, reply_ids: Sequence[str]) -> dict[str, str]:
    """reply_id -> content hash of what the receiver holds."""
    query = sa.select(receipts.c.reply_id, receipts.c.content_hash).where(
        receipts.c.reply_id.in_(list(reply_ids))
    )
    with reading(receiver_url) as conn:
        return {row.reply_id: row.content_hash for row in conn.execute(query)}


def delivered(outbox_url: str, reply_ids: Sequence[str]) -> bool:
    """Whether every one of these messages is sent."""
    query = sa.select(messages.c.state).where(messages.c.reply_id.in_(list(reply_ids)))
    with reading(outbox_url) as conn:
        return all(state == MessageState.SENT for state in conn.execute(query).scalars())


def delivery_records(outbox_url: str, reply_ids: Sequence[str]) -> dict[str, Any]:
    """reply_id -> (reply_id, task_id, state, attempts, content_hash) of each message."""
    query = sa.select(
        messages.c.reply_id,
        messages.c.task_id,
        messages.c.state,
        messages.c.attempts,
        messages.c.content_hash,
    ).where(messages.c.reply_id.in_(list(reply_ids)))
    with reading(outbox_url) as conn:
        return {row.reply_id: row for row in conn.execute(query)}


def task_states(outbox_url: str, task_ids: Sequence[str]) -> dict[str, str]:
    """task_id -> state."""
    query = sa.select(tasks.c.task_id, tasks.c.state).where(tasks.c.task_id.in_(list(task_ids)))
    with reading(outbox_url) as conn:
        return {row.task_id: row.state for row in conn.execute(query)}


def effect_counts(receiver_url: str, reply_ids: Sequence[str]) -> dict[str, int]:
    """reply_id -> how many receiver effects it has."""
    query = (
        sa.select(effects.c.reply_id, sa.func.count())
        .where(effects.c.reply_id.in_(list(reply_ids)))
        .group_by(effects.c.reply_id)
    )
    with reading(receiver_url) as conn:
        return {reply_id: int(count) for reply_id, count in conn.execute(query)}
