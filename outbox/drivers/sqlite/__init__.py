"""The SQLite driver (sqlite3): one writer, so no row locks; the portable statements as
they are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from outbox.drivers.base import Now
from outbox.drivers.common import CommonDriver
from outbox.drivers.common.pooled import PooledTaskConnections
from outbox.drivers.notifications import PollingOnly
from outbox.drivers.records import FailedAttempt, Settlement
from outbox.drivers.sqlite import settle as settling
from outbox.drivers.sqlite.clock import DATABASE_NOW
from outbox.drivers.sqlite.engine import SQLiteEngines
from outbox.drivers.sqlite.errors import SQLiteErrors
from outbox.drivers.sqlite.task_batches import SQLiteTaskBatches


class SQLiteDriver(
    SQLiteTaskBatches,
    SQLiteEngines,
    SQLiteErrors,
    PollingOnly,
    PooledTaskConnections,
    CommonDriver,
):
    """SQLite: the portable statements, with its own clock and INSERT, and its batches of
    task results and renewals."""

    name = "sqlite"
    supports_skip_locked = False

    def database_now(self) -> ColumnElement[float]:
        """julianday('now') in epoch seconds."""
        return sa.literal_column(DATABASE_NOW, sa.Double())

    def dialect_insert(self, table: sa.Table) -> Any:
        """SQLite's INSERT, with ON CONFLICT."""
        return sqlite.insert(table)

    def in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` IN the expanding list parameter `name`."""
        return column.in_(sa.bindparam(name, expanding=True))

    def not_in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` NOT IN the expanding list parameter `name`."""
        return column.not_in(sa.bindparam(name, expanding=True))

    def floor(self, value: ColumnElement[Any]) -> ColumnElement[int]:
        """A cast to integer, which truncates: floor for the positive values it is given."""
        # SQLite may be built without floor().
        return sa.cast(value, sa.Integer())

    def settle(
        self,
        conn: Connection,
        owner: str,
        rows: Sequence[Settlement],
        now: Now,
        failures: Sequence[FailedAttempt] = (),
    ) -> set[int]:
        """Settle held messages in one UPDATE FROM a JSON document; the ids it changed."""
        return settling.settle(conn, owner, rows, now, failures)
