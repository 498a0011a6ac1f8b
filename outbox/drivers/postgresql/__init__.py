"""The PostgreSQL driver (psycopg 3): array parameters, statement time, SKIP LOCKED."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from outbox.drivers.base import Now
from outbox.drivers.common import CommonDriver
from outbox.drivers.postgresql import listener as listen
from outbox.drivers.postgresql import receipts
from outbox.drivers.postgresql import settle as settling
from outbox.drivers.postgresql.claims import PostgreSQLClaims
from outbox.drivers.postgresql.engine import PostgreSQLEngines
from outbox.drivers.postgresql.errors import PostgreSQLErrors
from outbox.drivers.postgresql.estimates import PostgreSQLEstimates
from outbox.drivers.postgresql.held_tasks import (
    PsycopgHeldClaims,
    PsycopgHeldFinishes,
    held_conninfo,
)
from outbox.drivers.postgresql.reap import reap_recording_statement
from outbox.drivers.postgresql.receipts import STATEMENT_NOW
from outbox.drivers.postgresql.task_claims import PostgreSQLTaskClaims
from outbox.drivers.postgresql.task_renewals import PostgreSQLTaskRenewals
from outbox.drivers.postgresql.task_results import PostgreSQLTaskResults
from outbox.drivers.records import FailedAttempt, Settlement


class PostgreSQLDriver(
    PostgreSQLClaims,
    PostgreSQLTaskClaims,
    PostgreSQLTaskRenewals,
    PostgreSQLTaskResults,
    PostgreSQLEngines,
    PostgreSQLErrors,
    PostgreSQLEstimates,
    CommonDriver,
):
    """PostgreSQL: the portable statements, and one-statement receipt inserts, claims,
    settles, task results and renewals of its own."""

    name = "postgresql"
    supports_skip_locked = True
    fuses_reference_effect = True

    def held_task_claims(self, engine: Engine, owns_engine: bool) -> PsycopgHeldClaims | None:
        """Claims on a held psycopg connection of the loop, for an engine of the toolkit's."""
        conninfo = held_conninfo(engine, owns_engine)
        return None if conninfo is None else PsycopgHeldClaims(self, conninfo)

    def held_task_finishes(self, engine: Engine, owns_engine: bool) -> PsycopgHeldFinishes | None:
        """Batches of results on a held psycopg connection, as held_task_claims."""
        conninfo = held_conninfo(engine, owns_engine)
        return None if conninfo is None else PsycopgHeldFinishes(conninfo)

    def database_now(self) -> ColumnElement[float]:
        """The statement's time in epoch seconds."""
        # Statement time: stable within a statement (so indexes can use it) but current,
        # unlike now(), which would freeze at the start of a caller's long transaction.
        return sa.literal_column(STATEMENT_NOW, sa.Double())

    def dialect_insert(self, table: sa.Table) -> Any:
        """PostgreSQL's INSERT, with ON CONFLICT."""
        return postgresql.insert(table)

    def in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` equals any element of the array parameter `name`."""
        names = sa.bindparam(name, type_=postgresql.ARRAY(sa.String()))
        return column == sa.any_(names)

    def not_in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` differs from every element of the array parameter `name`."""
        # One array parameter: the same prepared statement for any number of names.
        names = sa.bindparam(name, type_=postgresql.ARRAY(sa.String()))
        return column != sa.all_(names)

    def floor(self, value: ColumnElement[Any]) -> ColumnElement[int]:
        """floor() as a bigint."""
        return sa.cast(sa.func.floor(value), sa.BigInteger())

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
        """Insert receipts (and, if asked, their reference effects) in one statement."""
        return receipts.insert_receipts(conn, reply_ids, hashes, bodies, now, with_reference_effect)

    def insert_effects(self, conn: Connection, fresh: Sequence[tuple[str, float, bytes]]) -> None:
        """The reference effect's rows in one statement of arrays."""
        receipts.insert_effects(conn, fresh)

    def settle(
        self,
        conn: Connection,
        owner: str,
        rows: Sequence[Settlement],
        now: Now,
        failures: Sequence[FailedAttempt] = (),
    ) -> set[int]:
        """Settle held messages in one statement of binary arrays, which records the failed
        attempts among them; the ids it changed."""
        return settling.settle(conn, owner, rows, now, failures)

    def reap_expired_message_leases(self, conn: Connection, now: Now, limit: int) -> int:
        """Return up to `limit` messages whose delivery lease expired to pending, and record
        their attempts, in one statement; how many."""
        reaped = conn.execute(reap_recording_statement(self), {"now": now, "limit": limit})
        return len(reaped.all())

    # One LISTEN connection on a channel, kept up (outbox.drivers.postgresql.listener).
    listener = staticmethod(listen.listener)
