"""Errors: each driver reads its backend's DBAPI errors for the one retry policy."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox.drivers import Driver


@pytest.fixture
def table(engine: sa.Engine) -> Iterator[str]:
    """A table of this test's own with one integer key, dropped at the end."""
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY)"))
    yield name
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {name}"))


def test_a_missing_table_is_told_apart_from_other_errors(driver: Driver, engine: sa.Engine) -> None:
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as missing:
        conn.execute(sa.text("SELECT 1 FROM outbox_no_such_table"))
    assert driver.is_missing_table(missing.value.orig)
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as other:
        conn.execute(sa.text("SELECT no_such_function_at_all()"))
    assert not driver.is_missing_table(other.value.orig)
    assert not driver.is_missing_table(None)


def test_a_constraint_is_not_transient(driver: Driver, engine: sa.Engine, table: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} (id) VALUES (1)"))
    with engine.begin() as conn, pytest.raises(sa.exc.IntegrityError) as twice:
        conn.execute(sa.text(f"INSERT INTO {table} (id) VALUES (1)"))
    assert driver.transient(twice.value.orig) is not True
    assert not driver.waited_for_lock(twice.value.orig)


def test_a_lock_wait_that_ran_out_is_transient(
    driver: Driver, engine: sa.Engine, table: str, backend: str, db_url: str
) -> None:
    with engine.begin() as holder:
        holder.execute(sa.text(f"INSERT INTO {table} (id) VALUES (1)"))
        error = lock_wait_error(engine, table, backend, db_url)
    assert driver.transient(error) is True
    # SQLite's busy timeout and InnoDB's lock wait timeout already waited; PostgreSQL's
    # toolkit statements skip locks.
    assert driver.waited_for_lock(error) == (backend in ("sqlite", "mysql"))


def lock_wait_error(engine: sa.Engine, table: str, backend: str, db_url: str) -> BaseException:
    """The DBAPI error of a second writer whose short lock wait runs out behind the first."""
    if backend == "sqlite":
        raw = sqlite3.connect(sa.make_url(db_url).database or "", timeout=0.05)
        raw.isolation_level = None
        try:
            with pytest.raises(sqlite3.OperationalError) as busy:
                raw.execute("BEGIN IMMEDIATE")
            return busy.value
        finally:
            raw.close()
    with engine.connect() as waiter:
        if backend == "mysql":
            # Whole seconds on MySQL 8; MariaDB takes fractions (and 0, no wait at all).
            waiter.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
        else:
            waiter.execute(sa.text("SET lock_timeout = '50ms'"))
        with pytest.raises(sa.exc.DBAPIError) as timed_out:
            waiter.execute(sa.text(f"INSERT INTO {table} (id) VALUES (1)"))
    return timed_out.value.orig  # type: ignore[return-value]


REFUSED = {
    # A trigger's or a procedure's own error, which PyMySQL calls operational.
    "mysql": ("SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused'", True),
    # An error psycopg calls operational is the store's own trouble, never a refusal.
    "postgresql": (
        "DO $$ BEGIN RAISE EXCEPTION 'refused' USING ERRCODE = 'program_limit_exceeded'; END $$",
        False,
    ),
}
"""A statement each server refuses with an error its DBAPI calls operational, and whether
the driver calls that error the statement's own."""


def test_the_servers_own_refusal_is_told_apart_from_an_unreachable_one(
    driver: Driver, engine: sa.Engine, table: str, backend: str, db_url: str
) -> None:
    if backend in REFUSED:
        statement, refused = REFUSED[backend]
        with engine.connect() as conn, pytest.raises(sa.exc.OperationalError) as error:
            conn.execute(sa.text(statement))
        assert driver.refused_statement(error.value.orig) is refused
    with engine.begin() as holder:
        holder.execute(sa.text(f"INSERT INTO {table} (id) VALUES (1)"))
        assert not driver.refused_statement(lock_wait_error(engine, table, backend, db_url))
    assert not driver.refused_statement(None)
