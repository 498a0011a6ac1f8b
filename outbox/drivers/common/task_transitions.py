"""A held task's guarded changes in portable Core: failed, released, cancelled; its row.

Each names the task, its owner and its fence under the lease and deadline guard
(held_guard): a statement that touches no row means the caller lost its lease.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox.db.sql import state_literal
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.task_interface import Held
from outbox.schema import tasks
from outbox.states import TaskState


def held_in_v(t: str, now: str, unindexed: bool = False) -> str:
    """held_guard in SQL text at `now`, for the batches matching each row of table `t` to
    the row of `v` with its held triple. `unindexed`: the state test written so that no
    partial index's predicate follows from it (as outbox.db.sql.state_unindexed)."""
    state = f"{t}.state || ''" if unindexed else f"{t}.state"
    return f"""
    {t}.task_id = v.task_id AND {state} = 'running' AND {t}.owner = v.owner
    AND {t}.fence = v.fence AND {t}.lease_until > {now} AND {t}.deadline > {now}
"""


def held_guard(now: sa.ColumnElement[float]) -> sa.ColumnElement[bool]:
    """:held_task is running under :holder and :held_fence, inside its lease and deadline."""
    return sa.and_(
        tasks.c.task_id == sa.bindparam("held_task", type_=sa.String()),
        tasks.c.state == state_literal(TaskState.RUNNING),
        tasks.c.owner == sa.bindparam("holder", type_=sa.String()),
        tasks.c.fence == sa.bindparam("held_fence", type_=sa.BigInteger()),
        tasks.c.lease_until > now,
        tasks.c.deadline > now,
    )


def holding(held: Held, now: float | None) -> dict[str, Any]:
    """held_guard's parameters naming `held`."""
    task_id, owner, fence = held
    return {"held_task": task_id, "holder": owner, "held_fence": fence, "now": now}


def fail_values(now: sa.ColumnElement[float]) -> dict[str, Any]:
    """The SET of a failure: pending again after :delay, or failed when :permanent or out of
    attempts; :reason its last error."""
    permanent = sa.bindparam("permanent", type_=sa.Boolean())
    final = sa.or_(permanent, tasks.c.attempts >= tasks.c.max_attempts)
    return {
        "state": sa.case((final, TaskState.FAILED.value), else_=TaskState.PENDING.value),
        "available_at": sa.case(
            (final, tasks.c.available_at),
            else_=now + sa.bindparam("delay", type_=sa.Double()),
        ),
        "finished_at": sa.case((final, now), else_=None),
        "lease_until": None,
        "last_error": sa.bindparam("reason", type_=sa.Text()),
        "updated_at": now,
    }


@functools.cache
def fail_task_statement(pieces: DriverPieces) -> sa.Update:
    """Send a held task back to pending after :delay, or to failed when it has no attempts left.
    :permanent fails it at once; :reason is stored as its last error. Built once.
    """
    now = pieces.bound_now()
    return (
        sa.update(tasks).where(held_guard(now)).values(**fail_values(now)).returning(tasks.c.state)
    )


def release_values(now: sa.ColumnElement[float]) -> dict[str, Any]:
    """The SET of a release: pending and due at once, its claim's attempt returned."""
    return {
        "state": TaskState.PENDING.value,
        "available_at": now,
        "lease_until": None,
        "attempts": tasks.c.attempts - 1,
        "updated_at": now,
    }


@functools.cache
def release_task_statement(pieces: DriverPieces) -> sa.Update:
    """Give a held task back unrun: pending and due at once, its claim's attempt returned."""
    now = pieces.bound_now()
    return (
        sa.update(tasks)
        .where(held_guard(now))
        .values(**release_values(now))
        .returning(tasks.c.state)
    )


@functools.cache
def cancel_task_statement(pieces: DriverPieces) -> sa.Update:
    """Cancel :cancelled_task at once when it is pending or running, :reason its last error;
    built once."""
    now = pieces.bound_now()
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id == sa.bindparam("cancelled_task", type_=sa.String()),
            tasks.c.state.in_((state_literal(TaskState.PENDING), state_literal(TaskState.RUNNING))),
        )
        .values(
            state=TaskState.CANCELLED.value,
            last_error=sa.bindparam("reason", type_=sa.Text()),
            cancel_requested_at=now,
            lease_until=None,
            finished_at=now,
            updated_at=now,
        )
    )


def select_task(task_id: str) -> sa.Select[Any]:
    """One task row."""
    return sa.select(tasks).where(tasks.c.task_id == task_id)


class TaskTransitionStatements(DriverPieces):
    """TaskTransitionsDriver in Core."""

    def fail_task(
        self,
        conn: Connection,
        held: Held,
        now: float | None,
        *,
        reason: str,
        permanent: bool,
        delay: float,
    ) -> str | None:
        """Send a held task back to pending after `delay`, or to failed when `permanent` or
        out of attempts; the state it went to, or None when it was not held."""
        params = {**holding(held, now), "reason": reason, "permanent": permanent, "delay": delay}
        state = conn.execute(fail_task_statement(self), params).scalar()
        return None if state is None else str(state)

    def release_task(self, conn: Connection, held: Held, now: float | None) -> bool:
        """Give a held task back unrun (pending at once, the attempt returned); whether held."""
        return conn.execute(release_task_statement(self), holding(held, now)).first() is not None

    def cancel_task(self, conn: Connection, task_id: str, reason: str, now: float | None) -> bool:
        """Cancel a pending or running task, `reason` its last error; whether it was."""
        params = {"cancelled_task": task_id, "reason": reason, "now": now}
        return conn.execute(cancel_task_statement(self), params).rowcount == 1

    def task_row(self, conn: Connection, task_id: str) -> RowMapping | None:
        """One task row, or None."""
        return conn.execute(select_task(task_id)).mappings().first()
