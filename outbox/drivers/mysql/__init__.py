"""The MySQL and MariaDB driver (PyMySQL): no RETURNING on UPDATE, no array parameters,
no notifications.

Where PostgreSQL writes and returns rows in one statement, this driver runs a locking
pick (`FOR UPDATE`, `SKIP LOCKED` where claimers compete: MySQL 8.0.17+, MariaDB
10.6+), an UPDATE by primary key and a read, all in the caller's transaction (see
`picks`). Workers and relays poll. Both `mysql` and `mariadb` dialect names run on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from outbox.drivers.base import Now
from outbox.drivers.common import CommonDriver
from outbox.drivers.common.pieces import upserted
from outbox.drivers.common.pooled import PooledTaskConnections
from outbox.drivers.mysql import settle as settling
from outbox.drivers.mysql.claims import MySQLClaims
from outbox.drivers.mysql.clock import DATABASE_NOW
from outbox.drivers.mysql.engine import MySQLEngines
from outbox.drivers.mysql.errors import MySQLErrors
from outbox.drivers.mysql.inserts import MySQLInserts
from outbox.drivers.mysql.task_batches import MySQLTaskBatches
from outbox.drivers.mysql.task_claims import MySQLTaskClaims
from outbox.drivers.mysql.task_reconcile import MySQLTaskReconcile
from outbox.drivers.mysql.task_transitions import MySQLTaskTransitions
from outbox.drivers.notifications import PollingOnly
from outbox.drivers.records import FailedAttempt, Settlement


class MySQLDriver(
    MySQLInserts,
    MySQLClaims,
    MySQLTaskClaims,
    MySQLTaskTransitions,
    MySQLTaskBatches,
    MySQLTaskReconcile,
    MySQLEngines,
    MySQLErrors,
    PollingOnly,
    PooledTaskConnections,
    CommonDriver,
):
    """MySQL and MariaDB: the portable statements where they run as they are, and its own
    inserts, claims, settles, task batches, transitions and reconciling."""

    name = "mysql"
    supports_skip_locked = True

    def database_now(self) -> ColumnElement[float]:
        """NOW(6) in epoch seconds."""
        return sa.literal_column(DATABASE_NOW, sa.Double())

    def dialect_insert(self, table: sa.Table) -> Any:
        """MySQL's INSERT, with ON DUPLICATE KEY UPDATE."""
        return mysql.insert(table)

    def insert_ignoring_conflicts(self, table: sa.Table) -> Any:
        """INSERT that leaves a row whose unique key exists as it is (its first primary key
        column set to itself)."""
        first = next(iter(table.primary_key.columns))
        return mysql.insert(table).on_duplicate_key_update({first.name: first})

    def upsert(
        self,
        table: sa.Table,
        keys: list[str],
        update: list[str],
        kept: Mapping[str, str] | None = None,
    ) -> Any:
        """INSERT that, where a row with the same unique key exists, sets its `update` columns;
        a column of `kept` keeps its stored value when the new row's column it names is NULL."""
        statement = mysql.insert(table)
        return statement.on_duplicate_key_update(
            upserted(table, update, kept or {}, statement.inserted)
        )

    def in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` IN the expanding list parameter `name`."""
        return column.in_(sa.bindparam(name, expanding=True))

    def not_in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` NOT IN the expanding list parameter `name`."""
        return column.not_in(sa.bindparam(name, expanding=True))

    def floor(self, value: ColumnElement[Any]) -> ColumnElement[int]:
        """FLOOR() as a signed integer."""
        return sa.cast(sa.func.floor(value), sa.BigInteger())

    def settle(
        self,
        conn: Connection,
        owner: str,
        rows: Sequence[Settlement],
        now: Now,
        failures: Sequence[FailedAttempt] = (),
    ) -> set[int]:
        """Settle held messages: the rows still held locked, then updated; the ids changed."""
        return settling.settle(conn, owner, rows, now, failures)
