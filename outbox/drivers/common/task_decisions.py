"""The statements behind the audit of operators' decisions about tasks, in portable Core."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import task_decisions

TASK_AUDITED = ("task_id", "action", "requested_by", "reason")
"""The values of a task decision's audit row its caller gives (requested_at is the
statement's)."""


@functools.cache
def insert_task_decision(pieces: DriverPieces) -> sa.Insert:
    """One audit row of a decision about a task, requested :now; built once."""
    given = {name: sa.bindparam(name, type_=task_decisions.c[name].type) for name in TASK_AUDITED}
    return task_decisions.insert().values(**given, requested_at=pieces.bound_now())


def select_task_decisions(task_id: str) -> sa.Select[Any]:
    """Every audited decision about one task, oldest first (ix_outbox_task_decisions_task_id)."""
    return (
        sa.select(task_decisions)
        .where(task_decisions.c.task_id == task_id)
        .order_by(task_decisions.c.id)
    )


def select_task_decision(decision_id: int) -> sa.Select[Any]:
    """One audit row of a task decision, by id."""
    return sa.select(task_decisions).where(task_decisions.c.id == decision_id)


class TaskDecisionStatements(DriverPieces):
    """TaskDecisionsDriver in Core."""

    def insert_task_decision(
        self, conn: Connection, values: dict[str, Any], now: Now
    ) -> dict[str, Any]:
        """One audit row of a decision about a task, requested `now`; returned whole."""
        statement = insert_task_decision(self).returning(*task_decisions.c)
        row = conn.execute(statement, {**values, "now": now})
        return dict(row.mappings().one())

    def task_decisions(self, conn: Connection, task_id: str) -> list[dict[str, Any]]:
        """Every audited decision about one task, oldest first."""
        return [dict(row) for row in conn.execute(select_task_decisions(task_id)).mappings()]
