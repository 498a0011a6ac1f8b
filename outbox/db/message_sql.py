"""The core's statements about messages that are not behind the driver yet.

The task path's writes and reads of replies, and its use of the relay's reap, move with
the task statements; publish(), the other reads of messages and the relay's statements
are the drivers' (outbox.drivers).
"""

from __future__ import annotations

import functools
from typing import Any, cast

import sqlalchemy as sa

from outbox.db.dialect import bound_now
from outbox.drivers import driver_for
from outbox.drivers.common.leases import reap_statement
from outbox.drivers.common.messages import message_values
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import messages


def reap_expired_message_leases(dialect_name: str) -> sa.Update:
    """The drivers' reap of expired delivery leases, for TaskQueue.reconcile until the task
    statements are the drivers' too (the relay runs it through its driver)."""
    # Every registered driver is built on DriverPieces (outbox.drivers.common).
    return reap_statement(cast(DriverPieces, driver_for(dialect_name)))


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
