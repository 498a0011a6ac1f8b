"""Engines and connections per backend; the SQL pieces are the drivers' (outbox.drivers).

SQLite: WAL, synchronous=FULL, a busy timeout, and BEGIN IMMEDIATE so a
transaction that will write takes the write lock up front (a deferred one
fails with "database is locked" when it upgrades under contention).
PostgreSQL: psycopg 3, FOR UPDATE SKIP LOCKED, NOTIFY on new messages.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from outbox import failpoints
from outbox.clock import Clock
from outbox.db.lane import Lane
from outbox.drivers import driver_for
from outbox.drivers.execution import UNPREPARED as UNPREPARED
from outbox.drivers.postgresql.conninfo import CONNECT_TIMEOUT, bounded

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Migration o0002 installs a trigger that notifies this channel on every insert of messages.
NOTIFY_CHANNEL = "outbox_messages"
# Migration o0008 notifies this channel when tasks are inserted or become due again.
TASKS_NOTIFY_CHANNEL = "outbox_tasks"
READ_ONLY = "outbox_read_only"
_PREPARED = "outbox_prepared"


# An application's URL names the same database through its own driver; the toolkit's
# own engines (commands, TaskQueue, Relay, ReceiptStore, migrations) are synchronous, and
# on PostgreSQL always psycopg 3, whatever driver the URL names (asyncpg, psycopg2,
# ...): their SQL binds psycopg's binary arrays and plans some statements unprepared.
SYNC_DRIVERS = {
    "postgres": "postgresql+psycopg",
    "sqlite+aiosqlite": "sqlite",
}
_OWN_POSTGRESQL_DRIVER = "postgresql+psycopg"
# asyncpg's URL options that libpq does not know: its TLS switch has a libpq name, its
# statement cache has no meaning for psycopg (which prepares by its own threshold).
# asyncpg's ssl=true verifies the server's certificate and name (a default SSL context).
_ASYNCPG_SSL_MODES = {"true": "verify-full", "false": "disable"}
_ASYNCPG_ONLY_OPTIONS = ("prepared_statement_cache_size", "prepared_statement_name_func")


def make_url(url: str | sa.URL) -> sa.URL:
    """Parse a database URL for the toolkit's own sync engine: psycopg 3 for any PostgreSQL
    URL (plain, asyncpg, psycopg2, ...), sqlite3 for an aiosqlite one."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql+asyncpg":
        parsed = _libpq_options(parsed)
    if parsed.drivername in SYNC_DRIVERS:
        parsed = parsed.set(drivername=SYNC_DRIVERS[parsed.drivername])
    if parsed.get_backend_name() == "postgresql":
        parsed = parsed.set(drivername=_OWN_POSTGRESQL_DRIVER)
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise ValueError(
            f"unsupported database {parsed.get_backend_name()!r}: use postgresql or sqlite"
        )
    return parsed


def _libpq_options(url: sa.URL) -> sa.URL:
    """An asyncpg URL's query with libpq's names: `ssl` is `sslmode`, cache options go."""
    query = dict(url.query)
    for option in _ASYNCPG_ONLY_OPTIONS:
        query.pop(option, None)
    if "ssl" in query:
        ssl = query.pop("ssl")
        if not isinstance(ssl, str):
            raise ValueError("give the ssl option of a database URL once")
        query["sslmode"] = _ASYNCPG_SSL_MODES.get(ssl.lower(), ssl)
    return url.set(query=query)


def create_engine(url: str | sa.URL, **kwargs: Any) -> Engine:
    """An engine for the outbox: psycopg 3 on PostgreSQL; WAL and BEGIN IMMEDIATE on SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise ValueError("an in-memory SQLite database is private to one connection: use a file")
    if parsed.get_backend_name() == "postgresql":
        kwargs.setdefault("pool_pre_ping", True)
        if "connect_timeout" not in parsed.query and not bounded(""):
            bound = {"connect_timeout": CONNECT_TIMEOUT}
            kwargs["connect_args"] = bound | kwargs.get("connect_args", {})
    return prepare_engine(sa.create_engine(parsed, **kwargs))


def prepare_engine(engine: Engine) -> Engine:
    """Install the SQLite transaction discipline, or PostgreSQL's UNPREPARED option (idempotent)."""
    if engine.dialect.name == "sqlite":
        if not event.contains(engine, "begin", _sqlite_begin):
            event.listen(engine, "begin", _sqlite_begin)
    elif engine.dialect.name == "postgresql":
        if not event.contains(engine, "do_execute", _execute_unprepared):
            event.listen(engine, "do_execute", _execute_unprepared)
    else:
        raise ValueError(f"unsupported database dialect {engine.dialect.name!r}")
    return engine


def _execute_unprepared(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
    # psycopg prepares a statement run five times, and PostgreSQL then may switch to a
    # generic plan: for a join on array parameters it guesses ten elements and can rescan
    # the whole array once per matched row. UNPREPARED statements are planned per run.
    if not context.execution_options.get(UNPREPARED):
        return False
    cursor.execute(statement, parameters, prepare=False)
    return True


def _sqlite_begin(conn: Connection) -> None:
    dbapi = conn.connection.dbapi_connection
    record = conn.connection
    if not record.info.get(_PREPARED):
        # Let us, not pysqlite, decide when transactions begin.
        dbapi.isolation_level = None  # type: ignore[union-attr]
        cursor = dbapi.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = FULL")
        finally:
            cursor.close()
        record.info[_PREPARED] = True
    read_only = conn.get_execution_options().get(READ_ONLY, False)
    conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def missing_sqlite_file(url: str | sa.URL) -> str | None:
    """The path of a SQLite database file that does not exist (a typo, not a new database)."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return None if Path(parsed.database).exists() else parsed.database


def is_missing_table(exc: sa.exc.DBAPIError) -> bool:
    """Whether a statement failed because a table it names does not exist (no schema)."""
    orig = exc.orig
    if getattr(orig, "sqlstate", None) == "42P01":  # PostgreSQL undefined_table
        return True
    return isinstance(orig, sqlite3.OperationalError) and str(orig).startswith("no such table")


def is_postgresql(dialect_name: str) -> bool:
    """Whether this backend is PostgreSQL: arrays, NOTIFY, driver SQL of its own."""
    return dialect_name == "postgresql"


def listen_conninfo(engine: Engine) -> str | None:
    """The libpq connection string for LISTEN on PostgreSQL; None where there is no NOTIFY."""
    if not is_postgresql(engine.dialect.name):
        return None
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


# --- time (the drivers' clocks, for the few statements of callers outside them) ----------


def now_expression(clock: Clock | None, dialect_name: str) -> ColumnElement[float]:
    """The "now" to put in a statement: a bound manual time or the database clock."""
    return driver_for(dialect_name).now_sql(clock_value(clock))


def bound_now(dialect_name: str) -> ColumnElement[float]:
    """The "now" of a statement built once: bind `now` to a manual time, or None (database)."""
    return driver_for(dialect_name).bound_now()


def clock_value(clock: Clock | None) -> float | None:
    """The `now` to bind: a manual clock's time, or None for the database's clock."""
    return None if clock is None else float(clock())


# --- one statement ------------------------------------------------------------------


_AUTOCOMMIT = "_outbox_autocommit"


def _autocommit(engine: Engine) -> Engine:
    # Built once per engine and kept on it (a cycle the collector frees with the engine):
    # a new option engine per statement costs CPU on hot paths.
    found: Engine | None = engine.__dict__.get(_AUTOCOMMIT)
    if found is None:
        found = engine.execution_options(isolation_level="AUTOCOMMIT")
        engine.__dict__[_AUTOCOMMIT] = found
    return found


def autocommit_lane(engine: Engine, setup: str | None = None) -> Lane:
    """A Lane of autocommit connections of `engine`, for one_statement(lane=...); `setup`
    runs on each connection it holds (see outbox.db.lane)."""
    return Lane(_autocommit(engine), setup)


@contextmanager
def one_statement(
    engine: Engine,
    window: str | None = None,
    *,
    single: bool = True,
    lane: Lane | None = None,
) -> Iterator[Connection]:
    """A connection for work whose statements are each atomic alone, else one transaction.

    On PostgreSQL, when `single`, the work runs in autocommit: a statement is
    atomic alone, and BEGIN and COMMIT would only add round trips. Otherwise
    (SQLite, or several statements) it is a transaction (BEGIN IMMEDIATE on
    SQLite), committed when the block ends. `window` names the before-commit
    failpoint the caller hits at the end of the block, once it has written
    something: while that failpoint is armed (a crash test), single statements
    run in the transaction too, so it fires while the database holds their
    uncommitted writes; they commit together as always. A single statement runs
    on `lane`'s held connection when one is given (see outbox.db.lane), else on
    one from the pool.
    """
    if single and is_postgresql(engine.dialect.name) and not (window and failpoints.armed(window)):
        with lane.connection() if lane is not None else _autocommit(engine).connect() as conn:
            yield conn
        return
    with engine.begin() as conn:
        yield conn
