"""The task family of the driver interface (see outbox.drivers.base): what `Driver` adds
for the task queue's statements, one Protocol per concept.

Behind it so far: intake's writes. The claims, transitions, renewals and reconciling
still run from outbox.db.task_sql.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

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
