"""Reconciling tasks on MySQL: candidates read along the index without locks, then locked
by primary key with the conditions checked again (SKIP LOCKED: two reconcilers share the
work), an UPDATE by task_id, and, for reaped leases, a read of the states they went to.

Not one locking walk of the index: InnoDB locks each record a locking range scan reads,
the first one past the range's end too, before it knows that record is out of range.
The deadline walk ends on the pending task due next, which a worker's claim then
skipped as locked: with a reconcile in every claim's transaction, two claimers of one
task could both come back empty. Probes by primary key lock the rows they name alone.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import state_literal
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.task_reconcile import (
    DEADLINE_PASSED,
    UNFINISHED,
    TaskReconcileStatements,
    expired_values,
    lease_expired_pick,
    lease_expired_values,
    past_deadline_pick,
)
from outbox.drivers.mysql.picks import by_keys, picked, write_picked
from outbox.drivers.task_interface import EndedTask
from outbox.schema import tasks
from outbox.states import TaskState


@functools.cache
def deadline_pick(pieces: DriverPieces) -> sa.Select[Any]:
    """Up to :limit past-deadline unfinished tasks' ids, read without locks."""
    return past_deadline_pick(pieces.bound_now())


@functools.cache
def deadline_lock(pieces: DriverPieces) -> sa.Select[Any]:
    """The :picked tasks still unfinished and past their deadline, locked by primary key."""
    return (
        sa.select(tasks.c.task_id)
        .where(
            by_keys(tasks.c.task_id),
            tasks.c.state.in_(UNFINISHED),
            tasks.c.deadline <= pieces.bound_now(),
        )
        .with_for_update(skip_locked=True)
    )


@functools.cache
def expire_update(pieces: DriverPieces) -> sa.Update:
    """Expire the :picked tasks."""
    now = pieces.bound_now()
    return sa.update(tasks).where(by_keys(tasks.c.task_id)).values(**expired_values(now))


@functools.cache
def lease_pick(pieces: DriverPieces) -> sa.Select[Any]:
    """Up to :limit running tasks' ids whose lease expired, read without locks."""
    return lease_expired_pick(pieces.bound_now())


@functools.cache
def lease_lock(pieces: DriverPieces) -> sa.Select[Any]:
    """The :picked tasks still running past their lease, locked by primary key."""
    return (
        sa.select(tasks.c.task_id)
        .where(
            by_keys(tasks.c.task_id),
            tasks.c.state == state_literal(TaskState.RUNNING),
            tasks.c.lease_until <= pieces.bound_now(),
        )
        .with_for_update(skip_locked=True)
    )


def locked(conn: Connection, pick: Any, lock: Any, params: dict[str, Any]) -> list[Any]:
    """The candidates `pick` reads that `lock` then locks by primary key."""
    candidates = picked(conn, pick, params)
    if not candidates:
        return []
    return picked(conn, lock, {**params, "picked": candidates})


@functools.cache
def lease_update(pieces: DriverPieces) -> sa.Update:
    """Return the :picked tasks to pending, or fail them when out of attempts."""
    now = pieces.bound_now()
    return sa.update(tasks).where(by_keys(tasks.c.task_id)).values(**lease_expired_values(now))


@functools.cache
def read_ended() -> sa.Select[Any]:
    """The :picked tasks' id, state and last error."""
    return sa.select(tasks.c.task_id, tasks.c.state, tasks.c.last_error).where(
        by_keys(tasks.c.task_id)
    )


class MySQLTaskReconcile(TaskReconcileStatements):
    """Deadlines and expired leases, picked then updated."""

    def expire_past_deadline(
        self, conn: Connection, now: float | None, limit: int
    ) -> list[EndedTask]:
        """Move up to `limit` pending or running tasks past their deadline to expired."""
        params = {"now": now, "limit": limit}
        ids = locked(conn, deadline_pick(self), deadline_lock(self), params)
        if ids:
            conn.execute(expire_update(self), {**params, "picked": ids})
        return [EndedTask(task_id, TaskState.EXPIRED.value, DEADLINE_PASSED) for task_id in ids]

    def reap_expired_task_leases(
        self, conn: Connection, now: float | None, limit: int
    ) -> list[EndedTask]:
        """Return up to `limit` running tasks whose lease expired to pending, or fail them
        when out of attempts."""
        params = {"now": now, "limit": limit}
        ids = locked(conn, lease_pick(self), lease_lock(self), params)
        rows = write_picked(conn, lease_update(self), read_ended(), ids, params)
        return [EndedTask(task_id, state, why) for task_id, state, why in rows]
