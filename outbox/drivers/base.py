"""The database driver interface: every statement of a family, behind one method each.

A driver is one backend's executor (see outbox.drivers for the registry). Its methods
run on the Connection they are given and return values, not statements: a backend
without RETURNING needs two statements where PostgreSQL needs one, and only the
driver knows. None of them begins, commits or rolls back: the caller owns the
transaction (a Session's, a Connection's, or autocommit). "Now" is a parameter: a
manual clock's time in epoch seconds, or None for the database's clock.

The interface is grouped by concept, each group a Protocol; `Driver` is all of them.
What a new backend implements is listed in docs/explanation/architecture.md
("Database drivers").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.sql.elements import ColumnElement

from outbox.dead_filter import DeadFilter
from outbox.drivers.console_interface import ConsoleDriver
from outbox.drivers.engines import EngineDriver
from outbox.drivers.errors import ErrorsDriver
from outbox.drivers.notifications import NotificationsDriver
from outbox.drivers.records import Now as Now
from outbox.drivers.relay_interface import RelayDriver
from outbox.drivers.task_decision_interface import TaskDecisionsDriver
from outbox.drivers.task_interface import (
    TaskClaimsDriver,
    TaskHeldConnectionsDriver,
    TaskIntakeDriver,
    TaskReconcileDriver,
    TaskRenewalsDriver,
    TaskResultsDriver,
    TaskTransitionsDriver,
)

StateTable = Literal["tasks", "messages"]
"""The tables whose rows have a `state` (outbox_tasks, outbox_messages)."""


class HeldReceipt(NamedTuple):
    """A stored receipt: its body's hash and when it was first received."""

    reply_id: str
    content_hash: str
    received_at: float


class Unrouted(NamedTuple):
    """Pending messages no live relay delivers, and the age of the oldest (None: none)."""

    pending: int
    oldest_age: float | None


class DeadOutcome(NamedTuple):
    """A dead message's id and last outcome: what a decision about it keeps in its audit."""

    id: int
    attempts: int
    last_status: int | None
    last_error: str | None


class DialectPieces(Protocol):
    """SQL pieces the statement builders behind the driver share: a backend's clock,
    INSERT, list parameters, row locks."""

    name: str
    """The SQLAlchemy dialect name this driver runs on."""
    supports_skip_locked: bool
    """Whether row locks with SKIP LOCKED exist (SQLite has one writer, so it needs none)."""

    def database_now(self) -> ColumnElement[float]:
        """SQL for the database's current time in epoch seconds."""
        ...

    def now_sql(self, now: Now) -> ColumnElement[float]:
        """The "now" to put in a statement: `now` written in, or the database clock."""
        ...

    def bound_now(self) -> ColumnElement[float]:
        """The "now" of a statement built once: bind `now` to a manual time, or None."""
        ...

    def insert_ignoring_conflicts(self, table: sa.Table) -> Any:
        """INSERT that skips a row whose unique key already exists (the caller then compares)."""
        ...

    def upsert(self, table: sa.Table, keys: list[str], update: list[str]) -> Any:
        """INSERT that, where the row with these `keys` exists, sets its `update` columns."""
        ...

    def in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` is one of the names bound to parameter `name` (a list)."""
        ...

    def not_in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` is none of the names bound to parameter `name` (a list)."""
        ...

    def floor(self, value: ColumnElement[Any]) -> ColumnElement[int]:
        """The whole number at or below a positive `value`."""
        ...


class ReceiptsDriver(Protocol):
    """The receiver's receipts (dedupe by reply_id and body hash) and reference effects."""

    def insert_receipts(
        self,
        conn: Connection,
        reply_ids: Sequence[str],
        hashes: Sequence[str],
        bodies: Sequence[bytes],
        now: Now,
        *,
        with_reference_effect: bool = False,
    ) -> dict[str, float]:
        """Insert receipts (distinct, checked reply_ids) unless stored; the new ones'
        received_at. `with_reference_effect`: write each new one's reference effect too
        (only where `fuses_reference_effect`)."""
        ...

    fuses_reference_effect: bool
    """Whether insert_receipts can write the reference effects in the same statement."""

    def insert_effects(self, conn: Connection, fresh: Sequence[tuple[str, float, bytes]]) -> None:
        """The reference effect's rows, (reply_id, received_at, body) each."""
        ...

    def held_receipts(self, conn: Connection, reply_ids: Sequence[str]) -> list[HeldReceipt]:
        """The stored receipts among `reply_ids`."""
        ...

    def receipt(self, conn: Connection, reply_id: str) -> HeldReceipt | None:
        """One stored receipt, or None."""
        ...

    def receipt_body(self, conn: Connection, reply_id: str) -> bytes | None:
        """One receipt's stored body, or None."""
        ...

    def purge_receipts(self, conn: Connection, now: Now, older_than: float, batch: int) -> int:
        """Delete up to `batch` receipts received over `older_than` seconds ago, oldest
        first; how many."""
        ...


class DeadLettersDriver(Protocol):
    """The broker consumers' dead letters: messages whose effect kept raising."""

    def insert_dead_letter(self, conn: Connection, row: dict[str, Any], now: Now) -> None:
        """Keep a message given up on; a reply_id already dead (another copy's) stays."""
        ...

    def dead_among(self, conn: Connection, reply_ids: Sequence[str]) -> set[str]:
        """Which of `reply_ids` are dead letters."""
        ...

    def dead_letters(self, conn: Connection, limit: int) -> list[dict[str, Any]]:
        """The oldest `limit` dead letters, without their bodies."""
        ...

    def dead_letter(self, conn: Connection, reply_id: str) -> RowMapping | None:
        """One dead letter, whole, or None."""
        ...

    def delete_dead_letter(self, conn: Connection, reply_id: str) -> int:
        """Forget one dead letter; how many were deleted (0 or 1)."""
        ...

    def delete_dead_letters_before(self, conn: Connection, now: Now, older_than: float) -> int:
        """Forget the dead letters given up on over `older_than` seconds ago; how many."""
        ...


class MessagesDriver(Protocol):
    """Outbox messages: publish, and reading them back."""

    def insert_message(self, conn: Connection, row: dict[str, Any], now: Now) -> RowMapping | None:
        """Insert one message as pending and due now unless its reply_id exists: the new
        row, or None when it existed."""
        ...

    def message(self, conn: Connection, reply_id: str) -> RowMapping | None:
        """One message row by reply_id, or None."""
        ...

    def messages_in_order(
        self, conn: Connection, state: str | None, limit: int | None
    ) -> list[RowMapping]:
        """Messages in sequence order, optionally of one state, at most `limit` of them."""
        ...

    def unrouted(self, conn: Connection, now: Now) -> Unrouted:
        """Pending messages whose destination no live relay announces."""
        ...


class OperationsDriver(Protocol):
    """`outbox status`, `outbox dead` (list, show, requeue, resolve) and `outbox purge`."""

    def state_counts(self, conn: Connection, table: StateTable) -> dict[str, int]:
        """Rows per state present in `table`."""
        ...

    def live_state_counts(self, conn: Connection, table: StateTable) -> dict[str, int]:
        """Rows in each of `table`'s live states (pending, running or sending, dead), counted
        through their partial indexes."""
        ...

    def state_estimates(self, conn: Connection, table: StateTable) -> dict[str, int] | None:
        """Rows per state as the database's statistics estimate them; None where it keeps
        none that say so."""
        ...

    def oldest_pending_age(self, conn: Connection, table: StateTable, now: Now) -> float | None:
        """Seconds since the oldest pending row of `table` was created, or None."""
        ...

    def dead_messages(
        self, conn: Connection, limit: int, now: Now, chosen: DeadFilter
    ) -> list[dict[str, Any]]:
        """Dead messages that match `chosen`, oldest first, each with its id and age."""
        ...

    def delivery_record(self, conn: Connection, reply_id: str) -> dict[str, Any] | None:
        """One message's delivery record (state, attempts, last outcome, body), or None."""
        ...

    def lock_dead(self, conn: Connection, reply_ids: Sequence[str]) -> dict[str, DeadOutcome]:
        """The dead messages among `reply_ids`, by reply_id, each with its id and last
        outcome, locked until the transaction ends."""
        ...

    def requeue_dead(self, conn: Connection, message_ids: Sequence[int], now: Now) -> int:
        """Make dead messages pending with a fresh budget; how many were still dead."""
        ...

    def resolve_dead(self, conn: Connection, message_ids: Sequence[int], now: Now) -> int:
        """Resolve dead messages for good (keeping their last outcome); how many were still
        dead."""
        ...

    def message_state(self, conn: Connection, reply_id: str) -> str | None:
        """One message's state, or None when there is no such message."""
        ...

    def insert_decision_audits(
        self, conn: Connection, rows: Sequence[dict[str, Any]], now: Now
    ) -> list[dict[str, Any]]:
        """The audit rows of decisions about dead messages (a reply_id once each), requested
        `now`; returned whole, in the order given."""
        ...

    def purge_messages(
        self, conn: Connection, now: Now, older_than: float, batch: int
    ) -> list[str]:
        """Delete up to `batch` messages sent, or resolved, over `older_than` seconds ago,
        oldest first; the state of each one deleted."""
        ...


class Driver(
    DialectPieces,
    ReceiptsDriver,
    DeadLettersDriver,
    MessagesDriver,
    OperationsDriver,
    ConsoleDriver,
    TaskDecisionsDriver,
    RelayDriver,
    TaskIntakeDriver,
    TaskClaimsDriver,
    TaskTransitionsDriver,
    TaskRenewalsDriver,
    TaskResultsDriver,
    TaskReconcileDriver,
    NotificationsDriver,
    EngineDriver,
    ErrorsDriver,
    TaskHeldConnectionsDriver,
    Protocol,
):
    """One backend's executor of every family behind the interface."""
