"""A look at the database from beside a transaction stopped at its before-commit failpoint.

`looking(engine, point)` arms `point` in-process; at its arrival, before Crash is
raised, a second connection looks: on PostgreSQL, which tables an open write
transaction (`idle in transaction`, with a transaction id) holds RowExclusiveLock
on: the uncommitted writes; on MySQL, which tables of the test's database an open InnoDB
transaction that changed rows holds write intentions on; on SQLite, whether the write
lock is taken.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import sqlalchemy as sa

from outbox import failpoints
from support.innodb_window import open_transactions

_WRITTEN = sa.text(
    "SELECT DISTINCT c.relname FROM pg_locks l "
    "JOIN pg_class c ON c.oid = l.relation JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() "
    "AND a.backend_xid IS NOT NULL AND a.state = 'idle in transaction' "
    "AND l.mode = 'RowExclusiveLock' AND c.relkind = 'r'"
)


@dataclass(frozen=True)
class Look:
    """What another connection saw at the failpoint."""

    written: frozenset[str]
    """PostgreSQL, MySQL: tables an open transaction has written and not committed."""
    write_locked: bool
    """SQLite: the database's write lock is held (elsewhere: some table is written)."""


def look(engine: sa.Engine) -> Look:
    """Look at the database now, from a connection of its own."""
    if engine.dialect.name == "sqlite":
        assert engine.url.database is not None
        probe = sqlite3.connect(engine.url.database, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return Look(frozenset(), write_locked=False)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
            return Look(frozenset(), write_locked=True)
        finally:
            probe.close()
    if engine.dialect.name == "mysql":
        written = frozenset().union(
            *(
                t.written
                for t in open_transactions(engine)
                if t.rows_changed > 0 and engine.url.database in t.databases
            )
        )
        return Look(written, write_locked=bool(written))
    with engine.connect() as conn:
        written = frozenset(str(name) for name in conn.execute(_WRITTEN).scalars())
    return Look(written, write_locked=bool(written))


@contextmanager
def looking(engine: sa.Engine, point: str) -> Iterator[list[Look]]:
    """Arm `point`; each arrival there is looked at (the list) before Crash is raised."""
    seen: list[Look] = []
    original = failpoints.hit

    def hit(name: str) -> None:
        if name == point and failpoints.armed(point):
            seen.append(look(engine))
        original(name)

    with mock.patch.object(failpoints, "hit", hit), failpoints.arm(point):
        yield seen
