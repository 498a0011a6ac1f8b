"""Reconciling tasks in portable Core: deadlines that passed, leases that expired.

Each statement picks at most :limit rows along a partial index of unfinished tasks
(tests/test_claim_plans.py), then updates them guarded.
"""

from __future__ import annotations

import functools

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import limit_parameter, picked_once, state_literal
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.task_interface import EndedTask
from outbox.schema import tasks
from outbox.states import TaskState


@functools.cache
def expire_past_deadline_statement(pieces: DriverPieces) -> sa.Update:
    """Move up to :limit pending or running tasks past their deadline to expired; built once."""
    now = pieces.bound_now()
    pick = tasks.alias("pick")
    unfinished = (state_literal(TaskState.PENDING), state_literal(TaskState.RUNNING))
    chosen = (
        sa.select(pick.c.task_id)
        .where(pick.c.state.in_(unfinished), pick.c.deadline <= now)
        .limit(limit_parameter())
    )
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id.in_(picked_once(chosen, pieces.supports_skip_locked)),
            tasks.c.state.in_(unfinished),
        )
        .values(
            state=TaskState.EXPIRED.value,
            lease_until=None,
            last_error="deadline passed",
            finished_at=now,
            updated_at=now,
        )
        .returning(tasks.c.task_id, tasks.c.last_error)
    )


@functools.cache
def reap_expired_task_leases_statement(pieces: DriverPieces) -> sa.Update:
    """Return up to :limit running tasks whose lease expired to pending, or fail them when
    out of attempts; built once."""
    now = pieces.bound_now()
    pick = tasks.alias("pick")
    chosen = (
        sa.select(pick.c.task_id)
        .where(pick.c.state == state_literal(TaskState.RUNNING), pick.c.lease_until <= now)
        .limit(limit_parameter())
    )
    exhausted = tasks.c.attempts >= tasks.c.max_attempts
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id.in_(picked_once(chosen, pieces.supports_skip_locked)),
            tasks.c.state == state_literal(TaskState.RUNNING),
        )
        .values(
            state=sa.case((exhausted, TaskState.FAILED.value), else_=TaskState.PENDING.value),
            last_error=sa.case(
                (exhausted, "lease expired with no attempts left"), else_="lease expired"
            ),
            finished_at=sa.case((exhausted, now), else_=None),
            available_at=now,
            lease_until=None,
            updated_at=now,
        )
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
