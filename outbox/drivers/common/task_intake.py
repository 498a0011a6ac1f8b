"""Task intake in portable Core: the inbox row, inserted once, and the task."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.task_interface import InboxEntry
from outbox.schema import inbox, tasks


def select_inbox_entry(principal: str, message_id: str) -> sa.Select[Any]:
    """The stored content hash and task of one inbox message."""
    return sa.select(inbox.c.content_hash, inbox.c.task_id).where(
        inbox.c.principal == principal, inbox.c.message_id == message_id
    )


class TaskIntakeStatements(DriverPieces):
    """TaskIntakeDriver in Core."""

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
        statement = self.insert_ignoring_conflicts(inbox).values(
            principal=principal,
            message_id=message_id,
            content_hash=content_hash,
            content=content,
            task_id=task_id,
            received_at=now,
        )
        return conn.execute(statement.returning(inbox.c.task_id)).first() is not None

    def inbox_entry(self, conn: Connection, principal: str, message_id: str) -> InboxEntry | None:
        """The stored hash and task of one inbox message, or None."""
        row = conn.execute(select_inbox_entry(principal, message_id)).first()
        return None if row is None else InboxEntry(str(row[0]), str(row[1]))

    def insert_task(self, conn: Connection, values: Mapping[str, Any]) -> None:
        """Insert one task row, its columns' values given."""
        conn.execute(sa.insert(tasks).values(dict(values)))
