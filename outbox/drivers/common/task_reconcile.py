"""Reconciling tasks in portable Core: deadlines that passed, leases that expired.

Each statement picks at most :limit rows along a partial index of unfinished tasks
(tests/test_claim_plans.py), then updates them guarded.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import limit_parameter, picked_once, state_literal
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.task_interface import EndedTask
from outbox.schema import tasks
from outbox.states import TaskState

UNFINISHED = (state_literal(TaskState.PENDING), state_literal(TaskState.RUNNING))
DEADLINE_PASSED = "deadline passed"


def past_deadline_pick(now: sa.ColumnElement[float]) -> sa.Select[Any]:
    """Up to :limit pending or running tasks' ids whose deadline passed."""
    pick = tasks.alias("pick")
    return (
        sa.select(pick.c.task_id)
        .where(pick.c.state.in_(UNFINISHED), pick.c.deadline <= now)
        .limit(limit_parameter())
    )


def expired_values(now: sa.ColumnElement[float]) -> dict[str, Any]:
    """The SET of a task whose deadline passed."""
    return {
        "state": TaskState.EXPIRED.value,
        "lease_until": None,
        "last_error": DEADLINE_PASSED,
        "finished_at": now,
        "updated_at": now,
    }


def lease_expired_pick(now: sa.ColumnElement[float]) -> sa.Select[Any]:
    """Up to :limit running tasks' ids whose lease expired."""
    pick = tasks.alias("pick")
    return (
        sa.select(pick.c.task_id)
        .where(pick.c.state == state_literal(TaskState.RUNNING), pick.c.lease_until <= now)
        .limit(limit_parameter())
    )


def lease_expired_values(now: sa.ColumnElement[float]) -> dict[str, Any]:
    """The SET of a running task whose lease expired: pending again, or failed when out of
    attempts."""
    exhausted = tasks.c.attempts >= tasks.c.max_attempts
    return {
        "state": sa.case((exhausted, TaskState.FAILED.value), else_=TaskState.PENDING.value),
        "last_error": sa.case(
            (exhausted, "lease expired with no attempts left"), else_="lease expired"
        ),
        "finished_at": sa.case((exhausted, now), else_=None),
        "available_at": now,
        "lease_until": None,
        "updated_at": now,
    }


@functools.cache
def expire_past_deadline_statement(pieces: DriverPieces) -> sa.Update:
    """Move up to :limit pending or running tasks past their deadline to expired; built once."""
    now = pieces.bound_now()
    chosen = past_deadline_pick(now)
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id.in_(picked_once(chosen, pieces.supports_skip_locked)),
            tasks.c.state.in_(UNFINISHED),
        )
        .values(**expired_values(now))
        .returning(tasks.c.task_id, tasks.c.last_error)
    )


@functools.cache
def reap_expired_task_leases_statement(pieces: DriverPieces) -> sa.Update:
    """Return up to :limit running tasks whose lease expired to pending, or fail them when
    out of attempts; built once."""
    now = pieces.bound_now()
    chosen = lease_expired_pick(now)
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id.in_(picked_once(chosen, pieces.supports_skip_locked)),
            tasks.c.state == state_literal(TaskState.RUNNING),
        )
        .values(**lease_expired_values(now))
        .returning(tasks.c.task_id, tasks.c.state, tasks.c.last_error)
    )


class TaskReconcileStatements(DriverPieces):
    """TaskReconcileDriver in Core."""

    def expire_past_deadline(
        self, conn: Connection, now: float | None, limit: int
    ) -> list[EndedTask]:
        """Move up to `limit` pending or running tasks past their deadline to expired."""
        rows = conn.execute(expire_past_deadline_statement(self), {"now": now, "limit": limit})
        return [EndedTask(task_id, TaskState.EXPIRED.value, why) for task_id, why in rows]

    def reap_expired_task_leases(
        self, conn: Connection, now: float | None, limit: int
    ) -> list[EndedTask]:
        """Return up to `limit` running tasks whose lease expired to pending, or fail them
        when out of attempts."""
        rows = conn.execute(reap_expired_task_leases_statement(self), {"now": now, "limit": limit})
        return [EndedTask(task_id, state, why) for task_id, state, why in rows]
