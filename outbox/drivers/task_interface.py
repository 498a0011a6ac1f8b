"""The task family of the driver interface (see outbox.drivers.base): what `Driver` adds
for the task queue's statements, one Protocol per concept.

Behind it so far: intake's writes and reconciling. The claims, transitions and
renewals still run from outbox.db.task_sql.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection


class InboxEntry(NamedTuple):
    """A stored inbox message: its content's hash and the task it made."""

    content_hash: str
    task_id: str


class TaskIntakeDriver(Protocol):
    """Intake's writes: the inbox row that makes intake idempotent, and the task."""

    def insert_inbox(
        self,
        conn: Connection,
        principal: str,
        message_id: str,
        content: str,
        content_hash: str,
        task_id: str,
        now: float,
    ) -> bool:
        """Insert an inbox row unless (principal, message_id) is stored; whether it was."""
        ...

    def inbox_entry(self, conn: Connection, principal: str, message_id: str) -> InboxEntry | None:
        """The stored hash and task of one inbox message, or None."""
        ...

    def insert_task(self, conn: Connection, values: Mapping[str, Any]) -> None:
        """Insert one task row, its columns' values given."""
        ...


class EndedTask(NamedTuple):
    """A task reconciling changed: its id, the state it went to, and why."""

    task_id: str
    state: str
    reason: str


class TaskReconcileDriver(Protocol):
    """Deadlines that passed and leases that expired, each a bounded guarded UPDATE."""

    def expire_past_deadline_statement(self) -> sa.Update:
        """expire_past_deadline's statement (:now, :limit), built once."""
        ...

    def reap_expired_task_leases_statement(self) -> sa.Update:
        """reap_expired_task_leases's statement (:now, :limit), built once."""
        ...

    def expire_past_deadline(
        self, conn: Connection, now: float | None, limit: int
    ) -> list[EndedTask]:
        """Move up to `limit` pending or running tasks past their deadline to expired."""
        ...

    def reap_expired_task_leases(
        self, conn: Connection, now: float | None, limit: int
    ) -> list[EndedTask]:
        """Return up to `limit` running tasks whose lease expired to pending, or fail them
        when out of attempts."""
        ...
