"""Task results in portable Core: each held task marked done, one guarded statement each,
and the replies of those it changed inserted as pending messages.

Many tasks finish in one statement where a backend can: each row matched by its
(task_id, owner, fence) triple and the same lease and deadline guard, so a stale
holder's row is left as it is and missing from RETURNING. COMPLETE_SET is the SET
both backends' batches share.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.messages import message_values
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.task_transitions import held_guard
from outbox.drivers.task_interface import Completion
from outbox.schema import messages, tasks
from outbox.states import TaskState

COMPLETE_SET = """
    state = 'done', result = v.result, lease_until = NULL, finished_at = {now}, updated_at = {now}
"""
"""The batches' SET clause: done, with the result of the row of `v`."""


def done_values(now: sa.ColumnElement[float]) -> dict[str, Any]:
    """The SET of a task done with :result."""
    return {
        "state": TaskState.DONE.value,
        "result": sa.bindparam("result", type_=sa.Text()),
        "lease_until": None,
        "finished_at": now,
        "updated_at": now,
    }


@functools.cache
def complete_task_statement(pieces: DriverPieces) -> sa.Update:
    """Mark one held task done with :result; built once."""
    now = pieces.bound_now()
    return (
        sa.update(tasks)
        .where(held_guard(now))
        .values(**done_values(now))
        .returning(tasks.c.task_id)
    )


@functools.cache
def insert_task_replies_statement(pieces: DriverPieces) -> Any:
    """INSERT task replies (one parameter set per row, each binding `now`); built once."""
    return message_values(sa.insert(messages), pieces.bound_now())


class TaskResultStatements(DriverPieces):
    """TaskResultsDriver in Core: the tasks marked done (mark_done, which a backend may do
    in one statement), then their replies."""

    def complete_tasks(
        self,
        conn: Connection,
        completions: Sequence[Completion],
        replies: Sequence[Mapping[str, Any]],
        now: float | None,
    ) -> set[str]:
        """Mark held tasks done with their results and insert the replies of those it
        changed; the task_ids it changed. `replies` are the completions' reply rows, in
        order."""
        if not completions:
            return set()
        done = self.mark_done(conn, completions, now)
        self.insert_task_replies(conn, [row for row in replies if row["task_id"] in done], now)
        return done

    def mark_done(
        self, conn: Connection, completions: Sequence[Completion], now: float | None
    ) -> set[str]:
        """Mark held tasks done, one guarded statement each; the task_ids it changed."""
        statement = complete_task_statement(self)
        done: set[str] = set()
        for task_id, owner, fence, result in completions:
            params = {"held_task": task_id, "holder": owner, "held_fence": fence, "now": now}
            changed = conn.execute(statement, {**params, "result": result}).scalar()
            if changed is not None:
                done.add(changed)
        return done

    def insert_task_replies(
        self, conn: Connection, replies: Sequence[Mapping[str, Any]], now: float | None
    ) -> None:
        """Insert task reply rows as pending messages due `now`."""
        if replies:
            rows = [{**row, "now": now} for row in replies]
            conn.execute(insert_task_replies_statement(self), rows)
