"""Engines and connections: each backend's set-up and SQL pieces are its driver's
(outbox.drivers); these are the toolkit's entry points to them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from outbox import failpoints
from outbox.clock import Clock
from outbox.db.lane import Lane
from outbox.drivers import DRIVERS, UnsupportedDatabase, driver_for, driver_for_url
from outbox.drivers.execution import READ_ONLY as READ_ONLY
from outbox.drivers.execution import UNPREPARED as UNPREPARED
from outbox.errors import ConfigError

# Migration o0002 installs a trigger that notifies this channel on every insert of messages.
NOTIFY_CHANNEL = "outbox_messages"
# Migration o0008 notifies this channel when tasks are inserted or become due again.
TASKS_NOTIFY_CHANNEL = "outbox_tasks"


def make_url(url: str | sa.URL) -> sa.URL:
    """Parse a database URL for the toolkit's own sync engine: the backend driver's own
    DBAPI (psycopg 3 for any PostgreSQL URL, sqlite3 for an aiosqlite one)."""
    parsed = sa.make_url(url)
    return driver_for_url(parsed).own_url(parsed)


def create_engine(url: str | sa.URL, **kwargs: Any) -> Engine:
    """An engine for the outbox, set up by its backend's driver (outbox.drivers.engines)."""
    parsed = make_url(url)
    for option, default in driver_for_url(parsed).engine_options(parsed).items():
        if option == "connect_args":
            kwargs[option] = default | kwargs.get(option, {})
        else:
            kwargs.setdefault(option, default)
    try:
        engine = sa.create_engine(parsed, **kwargs)
    except sa.exc.NoSuchModuleError:
        raise ConfigError(f"no database driver is named {parsed.drivername!r}") from None
    except ImportError as exc:
        raise ConfigError(unloadable_dbapi(parsed, exc)) from None
    return prepare_engine(engine)


def unloadable_dbapi(parsed: sa.URL, exc: ImportError) -> str:
    """Why the DBAPI `parsed` names cannot load: a module not installed (a driver a URL
    names explicitly, such as mysql+mysqldb; the toolkit's own is named with its extra by
    the driver's engine_options), or one installed that fails to import (a missing C
    library)."""
    named = f"database driver {parsed.drivername!r}"
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        reason = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return f"{named} cannot be loaded: {reason}"
    plain = parsed.set(drivername=parsed.get_backend_name())
    hint = ""
    if make_url(plain).drivername != parsed.drivername:
        hint = f" (a plain {plain.drivername}:// URL runs on the toolkit's own)"
    return f"{named} needs the Python module {exc.name!r}, which is not installed{hint}"


def prepare_engine(engine: Engine) -> Engine:
    """Install the backend's connection discipline on `engine` (idempotent)."""
    try:
        driver = driver_for(engine)
    except UnsupportedDatabase:
        raise ValueError(f"unsupported database dialect {engine.dialect.name!r}") from None
    driver.prepare_engine(engine)
    return engine


def missing_sqlite_file(url: str | sa.URL) -> str | None:
    """The path of a SQLite database file that does not exist (a typo, not a new database)."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return None if Path(parsed.database).exists() else parsed.database


def is_missing_table(exc: sa.exc.DBAPIError) -> bool:
    """Whether a statement failed because a table it names does not exist (no schema)."""
    return any(driver.is_missing_table(exc.orig) for driver in DRIVERS.values())


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

    When `single` and the backend's driver runs such work in autocommit
    (PostgreSQL), it does: a statement is atomic alone, and BEGIN and COMMIT would
    only add round trips. Otherwise (SQLite, or several statements) it is a
    transaction (BEGIN IMMEDIATE on SQLite), committed when the block ends.
    `window` names the before-commit failpoint the caller hits at the end of the
    block, once it has written something: while that failpoint is armed (a crash
    test), single statements run in the transaction too, so it fires while the
    database holds their uncommitted writes; they commit together as always. A single statement runs
    on `lane`'s held connection when one is given (see outbox.db.lane), else on
    one from the pool.
    """
    autocommit = single and driver_for(engine).autocommit_statements
    if autocommit and not (window and failpoints.armed(window)):
        with lane.connection() if lane is not None else _autocommit(engine).connect() as conn:
            yield conn
        return
    with engine.begin() as conn:
        yield conn
