"""The task family of the driver interface (see outbox.drivers.base): what `Driver` adds
for the task queue's statements, one Protocol per concept.

Intake's writes, claims, the guarded transitions, renewals, results with their replies,
and reconciling. Each guarded statement names the task, its owner and its fence under
the lease and deadline guard: a statement that touches no row means the caller lost
its lease.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from sqlalchemy.engine import Connection, Engine, RowMapping

Held = tuple[str, str, int]
"""(task_id, owner, fence) of a held lease."""
Completion = tuple[str, str, int, str]
"""(task_id, owner, fence, result as canonical JSON) of a task to mark done."""


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


class TaskClaimsDriver(Protocol):
    """Claims: the best claimable tasks leased to an owner, and the setting of the
    connection they run on."""

    def task_claim_session(self) -> str | None:
        """The SQL that sets up the connection task claims run on, or None."""
        ...

    def task_claim_transaction_setting(self, conn: Connection) -> None:
        """Give a claim inside a transaction of `conn` the claims connection's setting,
        until that transaction ends (nothing on an autocommit connection)."""
        ...

    def claim_tasks(
        self,
        conn: Connection,
        *,
        owner: str,
        now: float | None,
        lease: float,
        limit: int,
        tenant_cap: int | None = None,
    ) -> list[RowMapping]:
        """Lease up to `limit` of the best claimable tasks to `owner` (their rows in any
        order: RETURNING keeps none); with `tenant_cap`, none of a tenant already running
        that many (one by one: needs a transaction)."""
        ...


class TaskTransitionsDriver(Protocol):
    """The guarded changes of a held task besides its result, cancelling, and a task row."""

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
        ...

    def release_task(self, conn: Connection, held: Held, now: float | None) -> bool:
        """Give a held task back unrun (pending at once, the attempt returned); whether held."""
        ...

    def cancel_task(self, conn: Connection, task_id: str, reason: str, now: float | None) -> bool:
        """Cancel a pending or running task, `reason` its last error; whether it was."""
        ...

    def task_row(self, conn: Connection, task_id: str) -> RowMapping | None:
        """One task row, or None."""
        ...


class TaskRenewalsDriver(Protocol):
    """Leases extended: a worker's heartbeat, and the lease a claim still holds."""

    def renew_leases(
        self, conn: Connection, held: Sequence[Held], lease: float, now: float | None
    ) -> dict[Held, float]:
        """Extend by `lease` each of `held` that still holds, in one statement: the new
        lease_until of each extended. A row locked by a write under way may be skipped."""
        ...

    def held_lease(self, conn: Connection, held: Held, now: float | None) -> float | None:
        """lease_until of a task while `held` still holds it, else None."""
        ...


class TaskResultsDriver(Protocol):
    """Results written with their replies, and task replies alone."""

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
        ...

    def insert_task_replies(
        self, conn: Connection, replies: Sequence[Mapping[str, Any]], now: float | None
    ) -> None:
        """Insert task reply rows as pending messages due `now`."""
        ...


class HeldTaskClaims(Protocol):
    """A worker's claims on a connection it holds on its event loop, in autocommit."""

    async def claim_tasks(
        self, *, owner: str, now: float | None, lease: float, limit: int, window: str
    ) -> list[dict[str, Any]]:
        """Lease up to `limit` of the best claimable tasks to `owner` in one statement (no
        tenant cap). While failpoint `window` is armed, in a transaction it hits before
        its COMMIT once something was claimed."""
        ...

    async def close(self) -> None:
        """Close the held connection; claims after this raise RuntimeError."""
        ...


class HeldTaskFinishes(Protocol):
    """A worker's batches of results on a connection it holds on its event loop."""

    async def complete_tasks(
        self,
        completions: Sequence[Completion],
        replies: Sequence[Mapping[str, Any]],
        now: float | None,
        window: str,
    ) -> set[str]:
        """complete_tasks in autocommit statements; the task_ids they changed. While
        failpoint `window` is armed, in a transaction it hits before its COMMIT once
        something was written."""
        ...

    async def close(self) -> None:
        """Close the held connection; batches after this raise RuntimeError."""
        ...


class TaskHeldConnectionsDriver(Protocol):
    """The worker's held connections on its event loop, where the backend has them (the
    errors their client raises: outbox.drivers.errors, `database_errors`)."""

    def held_task_claims(self, engine: Engine, owns_engine: bool) -> HeldTaskClaims | None:
        """Claims on a held connection of `engine`'s database, opened at the first claim;
        None where the backend has none, or where `engine` is a caller's (its connection
        settings may live outside its URL)."""
        ...

    def held_task_finishes(self, engine: Engine, owns_engine: bool) -> HeldTaskFinishes | None:
        """Batches of results on a held connection, as held_task_claims."""
        ...
