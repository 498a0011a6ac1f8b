"""What the migrations and the declared schema build differently on MySQL and MariaDB.

Tables: InnoDB (row locks, SKIP LOCKED), utf8mb4 with a binary NO PAD collation
(utf8mb4_nopad_bin on MariaDB, utf8mb4_0900_bin on MySQL 8), so that identifiers
(reply_id, task ids, destinations, ordering keys) compare byte for byte as on PostgreSQL
and SQLite: under a case- and accent-insensitive collation 'A' and 'a' would be one
reply_id, and under a PAD SPACE one (utf8mb4_bin) 'a' and 'a '. Bodies and payloads:
LONGBLOB and LONGTEXT, where BLOB and TEXT stop at 64 KiB.

Indexes: MySQL has no partial indexes. Each PostgreSQL index whose predicate names a
state has an InnoDB counterpart of its own name (INNODB_INDEXES) that leads with
`state` (or, for the ordering walk, puts it after the key): an equality on the state
then starts a range of exactly the rows the partial index holds, in the partial
index's order, so a claim walks them in order and stops at its LIMIT however much
finished history the table holds. Finished rows sit in other ranges of the same index
and are never read. A predicate that only leaves NULLs out needs no counterpart: the
plain index with the same name serves (a unique index never compares NULLs, and a
range never reaches them). The longest key, (destination, ordering_key, state, id),
is 200 + 200 + 16 characters of four bytes and a BIGINT: 1,672 bytes, under InnoDB's
3,072.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from alembic import op

MYSQL = ("mysql", "mariadb")
"""SQLAlchemy's dialect names for MySQL and MariaDB (`mariadb://` URLs get the second)."""
TABLE_OPTIONS: dict[str, Any] = {
    f"{dialect}_{option}": value
    for dialect in MYSQL
    for option, value in (("engine", "InnoDB"), ("charset", "utf8mb4"))
}
"""The declared tables' options on MySQL and MariaDB (ignored elsewhere); the migrations
add the binary collation of the server they run on (table_options)."""
MARIADB_COLLATION = "utf8mb4_nopad_bin"
MYSQL_COLLATION = "utf8mb4_0900_bin"  # MySQL 8.0.17+: the reason for that floor
# Binary and NO PAD: utf8mb4_bin pads with spaces when it compares, so 'order-1' and
# 'order-1 ' would be one reply_id. MariaDB (10.2+) and MySQL 8 name their NO PAD binary
# collations differently.


def table_options() -> dict[str, Any]:
    """TABLE_OPTIONS with the NO PAD binary collation of the server a migration runs on."""
    bind = op.get_bind()
    if not on_mysql(bind):
        return TABLE_OPTIONS
    mariadb = bool(getattr(bind.dialect, "is_mariadb", False))
    collation = MARIADB_COLLATION if mariadb else MYSQL_COLLATION
    return TABLE_OPTIONS | {f"{dialect}_collate": collation for dialect in MYSQL}


LongBinary = sa.LargeBinary().with_variant(mysql.LONGBLOB(), *MYSQL)
"""Bytes of any length: LONGBLOB on MySQL, whose BLOB holds 64 KiB."""
LongText = sa.Text().with_variant(mysql.LONGTEXT(), *MYSQL)
"""Text of any length: LONGTEXT on MySQL, whose TEXT holds 64 KiB."""

INNODB_INDEXES: dict[str, tuple[str, tuple[str, ...]] | None] = {
    # Claims: pending tasks in claim order.
    "ix_outbox_tasks_claimable": (
        "ix_outbox_tasks_state_claimable",
        ("state", "priority DESC", "available_at", "created_at"),
    ),
    # The reaper of expired task leases (dropped by o0011 on every backend).
    "ix_outbox_tasks_lease": ("ix_outbox_tasks_state_lease", ("state", "lease_until")),
    # Running tasks per tenant, for the tenant cap and the reaper.
    "ix_outbox_tasks_running_tenant": ("ix_outbox_tasks_state_tenant", ("state", "tenant_id")),
    # Unfinished tasks by deadline: two states, each range in deadline order.
    "ix_outbox_tasks_deadline": ("ix_outbox_tasks_state_deadline", ("state", "deadline")),
    # The relay's claim: pending messages in claim order.
    "ix_outbox_messages_deliverable": (
        "ix_outbox_messages_state_deliverable",
        ("state", "available_at", "id"),
    ),
    # The reaper of expired delivery leases.
    "ix_outbox_messages_lease": ("ix_outbox_messages_state_lease", ("state", "lease_until")),
    # A key's undelivered messages in id order: the state after the key, so that one probe
    # per key finds its pending and sending messages, its delivered history left aside.
    "ix_outbox_messages_ordering": (
        "ix_outbox_messages_state_ordering",
        ("destination", "ordering_key", "state", "id"),
    ),
    # Dead messages per destination.
    "ix_outbox_messages_dead": ("ix_outbox_messages_state_dead", ("state", "destination", "id")),
    # The console's sent per minute.
    "ix_outbox_messages_sent": ("ix_outbox_messages_state_sent", ("state", "sent_at")),
    # The console's lists of tasks that ended other than done: ix_outbox_tasks_state_deadline
    # (state, deadline) holds every task on MySQL, so each state is a range of it.
    "ix_outbox_tasks_unsuccessful": None,
    # The console's list of resolved messages: ix_outbox_messages_state_dead (state,
    # destination, id) holds that range too.
    "ix_outbox_messages_resolved": None,
    # The console's dead per minute: ix_outbox_messages_state_deliverable (state,
    # available_at, id) already holds that range, so no index of its own.
    "ix_outbox_messages_died": None,
}
"""Each state-predicated partial index's InnoDB counterpart (name, columns), or None where
another counterpart serves."""


class BuiltOn:
    """The test of an Index's ddl_if: whether the dialect is one of `dialects`."""

    def __init__(self, *dialects: str) -> None:
        self.dialects = dialects

    def __call__(
        self,
        ddl: Any,
        target: Any,
        bind: Any,
        tables: Any = None,
        state: Any = None,
        *,
        dialect: sa.Dialect,
        compiler: Any = None,
        checkfirst: bool = False,
    ) -> bool:
        """Whether an index is built on `dialect`."""
        return dialect.name in self.dialects


def on_mysql(bind: sa.engine.Connection) -> bool:
    """Whether a migration runs on MySQL or MariaDB."""
    return bind.dialect.name in MYSQL


def create_partial_index(
    name: str,
    table: str,
    columns: Sequence[str],
    where: str,
    *,
    unique: bool = False,
    if_not_exists: bool = False,
) -> None:
    """A partial index where the backend has them, its InnoDB counterpart on MySQL (inside
    a migration)."""
    if not on_mysql(op.get_bind()):
        predicate = sa.text(where)
        op.create_index(
            name,
            table,
            [_column(c) for c in columns],
            unique=unique,
            postgresql_where=predicate,
            sqlite_where=predicate,
            if_not_exists=if_not_exists,
        )
        return
    # MySQL 8 has no CREATE INDEX IF NOT EXISTS (MariaDB has): its index is built here.
    if name not in INNODB_INDEXES:
        op.create_index(name, table, list(columns), unique=unique)
        return
    counterpart = INNODB_INDEXES[name]
    if counterpart is not None:
        innodb_name, innodb_columns = counterpart
        op.create_index(innodb_name, table, [_column(c) for c in innodb_columns], unique=unique)


def drop_invalid_index(name: str, table: str) -> None:
    """Drop index `name` of `table` if a concurrent build that failed half way left it
    invalid (PostgreSQL; inside a migration): an index built beforehand is kept only when
    it is valid, as no query can use an invalid one and it would otherwise stay for good."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    valid = bind.execute(
        sa.text(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = :name AND c.relnamespace = to_regnamespace(current_schema())"
        ),
        {"name": name},
    ).scalar_one_or_none()
    if valid is False:
        op.drop_index(name, table_name=table)


def drop_partial_index(name: str, table: str, *, if_exists: bool = False) -> None:
    """Drop what create_partial_index built."""
    if not on_mysql(op.get_bind()):
        op.drop_index(name, table_name=table, if_exists=if_exists)
        return
    if name not in INNODB_INDEXES:
        op.drop_index(name, table_name=table)
        return
    counterpart = INNODB_INDEXES[name]
    if counterpart is not None:
        op.drop_index(counterpart[0], table_name=table)


MYSQL_ROUTABLE = "ix_outbox_messages_state_routable"
"""MySQL's claims per destination: (state, destination, ordering_key, available_at, id), so
that the unkeyed pending messages are one range in claim order and the keys with a pending
message read in key order (outbox.drivers.mysql.key_walk). Not a
counterpart: PostgreSQL claims along indexes of its own (ix_outbox_messages_unkeyed) and
SQLite's one relay walks ix_outbox_messages_deliverable."""
INNODB_NAMES = frozenset(c[0] for c in INNODB_INDEXES.values() if c is not None) | {MYSQL_ROUTABLE}
"""The indexes built on MySQL alone: the counterparts and MYSQL_ROUTABLE."""


def innodb_name(name: str) -> str:
    """The name of partial index `name`'s InnoDB counterpart (KeyError: it has none)."""
    counterpart = INNODB_INDEXES[name]
    if counterpart is None:
        raise KeyError(f"{name} has no InnoDB counterpart of its own")
    return counterpart[0]


def innodb_index(table: sa.Table, name: str) -> sa.Index | None:
    """The declared InnoDB counterpart of partial index `name` of `table`, built on MySQL
    alone; None where another serves."""
    counterpart = INNODB_INDEXES[name]
    if counterpart is None:
        return None
    innodb_name, columns = counterpart
    index = sa.Index(innodb_name, *(_declared(table, c) for c in columns))
    return index.ddl_if(callable_=BuiltOn(*MYSQL))


def _column(spec: str) -> Any:
    """A column name, or an expression such as `priority DESC`."""
    return sa.text(spec) if " " in spec else spec


def _declared(table: sa.Table, spec: str) -> Any:
    """A column of `table` for a declared Index, descending where `spec` says so."""
    column_name, _, order = spec.partition(" ")
    column = table.c[column_name]
    return column.desc() if order == "DESC" else column
