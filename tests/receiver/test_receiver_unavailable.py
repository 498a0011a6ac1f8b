"""Which database errors the receiver calls "store unavailable" (503, try later) and which
it leaves to the statement or effect that raised them (the item's own error).

PyMySQL calls every server error it has no class for operational, a trigger's SIGNAL
as much as access denied or a full disk; psycopg calls some of the store's own trouble
operational too (54000 on the way to wraparound). Each error here is what the DBAPI
raises, wrapped as SQLAlchemy wraps it.
"""

from __future__ import annotations

import sqlite3

import psycopg
import pymysql
import pytest
import sqlalchemy as sa

from receiver.unavailable import unavailable


def wrapped(error: Exception) -> sa.exc.DBAPIError:
    """`error` as SQLAlchemy raises it from a statement."""
    return sa.exc.DBAPIError.instance("SELECT 1", {}, error, Exception)


CASES = [
    # MySQL: the server refused the statement itself: the effect's error.
    (pymysql.err.OperationalError(1644, "effect refused"), False),
    (pymysql.err.OperationalError(4025, "CONSTRAINT `c` failed"), False),
    # MySQL: the store cannot work now.
    (pymysql.err.OperationalError(2003, "Can't connect"), True),
    (pymysql.err.OperationalError(2013, "Lost connection"), True),
    (pymysql.err.OperationalError(1045, "Access denied"), True),
    (pymysql.err.OperationalError(1021, "Disk full"), True),
    (
        pymysql.err.OperationalError(1969, "Query execution was interrupted (max_statement_time)"),
        True,
    ),
    (pymysql.err.OperationalError(1213, "Deadlock found"), True),
    (pymysql.err.InterfaceError(0, ""), True),
    # PostgreSQL: operational SQLSTATEs are the store's; a RAISE is a ProgrammingError.
    (psycopg.errors.ProgramLimitExceeded("database is not accepting commands"), True),
    (psycopg.errors.AdminShutdown("terminating connection"), True),
    (psycopg.OperationalError("connection refused"), True),
    (psycopg.errors.RaiseException("effect refused"), False),
    # SQLite: a file that cannot be opened.
    (sqlite3.OperationalError("unable to open database file"), True),
]


@pytest.mark.parametrize(("error", "store_unavailable"), CASES, ids=lambda v: repr(v)[:60])
def test_each_error_is_the_stores_or_the_statements(
    error: Exception, store_unavailable: bool
) -> None:
    assert (unavailable(wrapped(error)) is not None) is store_unavailable
