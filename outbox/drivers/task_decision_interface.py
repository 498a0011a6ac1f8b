"""The task decisions' family of the driver interface (see outbox.drivers.base): an
operator's cancel of a task, audited, and the audit read back."""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy.engine import Connection


class TaskDecisionsDriver(Protocol):
    """The audit of operators' decisions about tasks (outbox_task_decisions)."""

    def insert_task_decision(
        self, conn: Connection, values: dict[str, Any], now: float | None
    ) -> dict[str, Any]:
        """One audit row of a decision about a task (task_id, action, requested_by,
        reason), requested `now`; returned whole."""
        ...

    def task_decisions(self, conn: Connection, task_id: str) -> list[dict[str, Any]]:
        """Every audited decision about one task, oldest first."""
        ...
