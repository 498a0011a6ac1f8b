"""A held task failed or released on MySQL: the guarded UPDATE, then its new state read.

The UPDATE's guard decides whether the task was held; once it matched, the row is this
transaction's until it ends, so the read returns what the UPDATE wrote.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.task_transitions import (
    TaskTransitionStatements,
    fail_values,
    held_guard,
    holding,
    release_values,
)
from outbox.drivers.task_interface import Held
from outbox.schema import tasks


@functools.cache
def fail_update(pieces: DriverPieces) -> sa.Update:
    """Fail the held task (fail_values); built once."""
    now = pieces.bound_now()
    return sa.update(tasks).where(held_guard(now)).values(**fail_values(now))


@functools.cache
def release_update(pieces: DriverPieces) -> sa.Update:
    """Give the held task back unrun (release_values); built once."""
    now = pieces.bound_now()
    return sa.update(tasks).where(held_guard(now)).values(**release_values(now))


def select_state(task_id: str) -> sa.Select[Any]:
    """One task's state."""
    return sa.select(tasks.c.state).where(tasks.c.task_id == task_id)


class MySQLTaskTransitions(TaskTransitionStatements):
    """Fail and release without RETURNING."""

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
        if conn.execute(fail_update(self), params).rowcount != 1:
            return None
        return str(conn.execute(select_state(held[0])).scalar_one())

    def release_task(self, conn: Connection, held: Held, now: float | None) -> bool:
        """Give a held task back unrun (pending at once, the attempt returned); whether held."""
        return bool(conn.execute(release_update(self), holding(held, now)).rowcount == 1)
