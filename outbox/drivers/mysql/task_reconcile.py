"""Reconciling tasks on MySQL: each a locking pick of at most :limit rows (SKIP LOCKED:
two reconcilers share the work), an UPDATE by task_id, and, for reaped leases, a read
of the states they went to."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.task_reconcile import (
    DEADLINE_PASSED,
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
    """Past-deadline unfinished tasks, locked."""
    return past_deadline_pick(pieces.bound_now()).with_for_update(skip_locked=True)


@functools.cache
def expire_update(pieces: DriverPieces) -> sa.Update:
    """Expire the :picked tasks."""
    now = pieces.bound_now()
    return sa.update(tasks).where(by_keys(tasks.c.task_id)).values(**expired_values(now))


@functools.cache
def lease_pick(pieces: DriverPieces) -> sa.Select[Any]:
    """Running tasks whose lease expired, locked."""
    return lease_expired_pick(pieces.bound_now()).with_for_update(skip_locked=True)


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
        ids = picked(conn, deadline_pick(self), params)
        if ids:
            conn.execute(expire_update(self), {**params, "picked": ids})
        return [EndedTask(task_id, TaskState.EXPIRED.value, DEADLINE_PASSED) for task_id in ids]

    def reap_expired_task_leases(
        self, conn: Connection, now: float | None, limit: int
    ) -> list[EndedTask]:
        """Return up to `limit` running tasks whose lease expired to pending, or fail them
        when out of attempts."""
        params = {"now": now, "limit": limit}
        ids = picked(conn, lease_pick(self), params)
        rows = write_picked(conn, lease_update(self), read_ended(), ids, params)
        return [EndedTask(task_id, state, why) for task_id, state, why in rows]
