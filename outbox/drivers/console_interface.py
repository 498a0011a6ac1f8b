"""The console's family of the driver interface (see outbox.drivers.base): what `outbox
console` reads besides the operations, its audit page and its health rows."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from sqlalchemy.engine import Connection

from outbox.drivers.records import AuditedPage, ListedPage, ListedTasks, RelayRow, WorkerRow

Series = Literal["enqueued", "sent", "dead", "finished"]
"""What the console's charts count per minute."""


class ConsoleDriver(Protocol):
    """What `outbox console` reads besides the operations."""

    def task(self, conn: Connection, task_id: str) -> dict[str, Any] | None:
        """One task, as the task page shows it, or None."""
        ...

    def reply_of(self, conn: Connection, task_id: str) -> dict[str, Any] | None:
        """The reply_id and state of the reply a task wrote, or None."""
        ...

    def decisions(self, conn: Connection, reply_id: str) -> list[dict[str, Any]]:
        """Every audited decision about one message, oldest first."""
        ...

    def failed_attempts(
        self, conn: Connection, message_id: int, limit: int, since: float
    ) -> list[dict[str, Any]]:
        """A message's newest `limit` failed attempts made since `since` (its creation),
        the oldest of them first."""
        ...

    def audit_page(self, conn: Connection, page: AuditedPage) -> list[dict[str, Any]]:
        """Decisions about dead messages (requeue, resolve) and about tasks (cancel), as
        `page` chooses: up to `page.limit` of each kind, each kind's before its own id,
        merged newest first (by requested_at, then kind, then id), so that the first
        `page.limit` are the newest of all; each row has its `kind`, `reply_id` or
        `task_id`, and what a reply's decision keeps besides (NULL for a task's)."""
        ...

    def messages_in_state(self, conn: Connection, page: ListedPage) -> list[dict[str, Any]]:
        """One page of messages in a state (ListedPage says which, and after what), each with
        its `listed_key`, the value of the column the list is in the order of."""
        ...

    def tasks_in_state(self, conn: Connection, page: ListedTasks) -> list[dict[str, Any]]:
        """One page of tasks in a state (ListedTasks says which, and after what), each with
        its `listed_key`, the value of the column the list is in the order of."""
        ...

    def message_exists(self, conn: Connection, reply_id: str) -> bool:
        """Whether a message has this reply_id."""
        ...

    def per_minute(
        self,
        conn: Connection,
        series: Series,
        since: float,
        until: float,
        destination: str | None = None,
    ) -> dict[int, int]:
        """The count of each minute (epoch minute number) of one series in [since, until),
        of one destination's messages if given (not of tasks, which have none)."""
        ...

    def relay_announcements(self, conn: Connection) -> list[RelayRow]:
        """Every relay's announcement of each destination, recently lapsed ones included."""
        ...

    def worker_announcements(self, conn: Connection) -> list[WorkerRow]:
        """Every worker's announcement, recently lapsed ones included."""
        ...

    def oldest_ages(
        self, conn: Connection, since: float, until: float, destination: str | None = None
    ) -> dict[float, float]:
        """Minute start -> the oldest undelivered age sampled then (of `destination`, or the
        greatest of all), for the sampled minutes in [since, until)."""
        ...

    def dead_since(self, conn: Connection, since: float) -> dict[str, int]:
        """Messages per destination that went dead (their last attempt due) since `since`."""
        ...
