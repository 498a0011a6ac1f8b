"""outbox.db.retry: which errors are worth another try, and the two policies built on it."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from outbox.db import retry


class PgError(Exception):
    """A driver error carrying a SQLSTATE, as psycopg's do."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def lost() -> sa.exc.OperationalError:
    return sa.exc.OperationalError("SELECT 1", {}, Exception("connection lost"))


def failing(errors: list[BaseException]) -> tuple[list[int], Callable[[], int]]:
    """An operation raising `errors` in turn, then returning how many calls it took."""
    calls: list[int] = []

    def operation() -> int:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return len(calls)

    return calls, operation


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (lost(), True),
        (sa.exc.OperationalError("x", {}, PgError("40001")), True),  # serialization failure
        (sa.exc.OperationalError("x", {}, PgError("25006")), True),  # read-only: failover
        (sa.exc.OperationalError("x", {}, PgError("53300")), True),  # too many connections
        (sa.exc.IntegrityError("x", {}, PgError("23505")), False),  # unique violation
        (sa.exc.ProgrammingError("x", {}, PgError("42P01")), False),  # no such table
        (sa.exc.IntegrityError("x", {}, Exception("constraint")), False),
        (ValueError("not a database error"), False),
    ],
)
def test_transient_is_what_passes_with_time(error: BaseException, transient: bool) -> None:
    assert retry.is_transient(error) is transient


def test_sqlite_busy_is_transient_and_a_wait_already_spent() -> None:
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
    error = sa.exc.OperationalError("x", {}, busy)
    assert retry.is_transient(error)
    assert retry.waited_for_lock(error)
    assert not retry.waited_for_lock(lost())


def test_quickly_tries_again_on_transient_errors_only() -> None:
    calls, operation = failing([lost(), lost()])
    assert retry.quickly(operation) == 3
    calls, operation = failing([sa.exc.IntegrityError("x", {}, Exception())])
    with pytest.raises(sa.exc.IntegrityError):
        retry.quickly(operation)
    assert len(calls) == 1
    calls, operation = failing([lost()] * 5)
    with pytest.raises(sa.exc.OperationalError):
        retry.quickly(operation, tries=3)
    assert len(calls) == 3


def test_until_stops_when_told_and_trusts_a_write_found_done() -> None:
    stop = threading.Event()
    retried: list[BaseException] = []
    calls, operation = failing([lost()])
    got = retry.until(
        operation,
        seconds=5,
        stop=stop,
        done_despite=lambda exc: False,
        on_retry=retried.append,
    )
    assert (got, len(calls), len(retried)) == (2, 2, 1)
    calls, operation = failing([lost()])
    done = retry.until(operation, seconds=5, stop=stop, done_despite=lambda exc: True)
    assert (done, len(calls)) == (None, 1)  # the COMMIT happened: no second write
    stop.set()
    calls, operation = failing([lost()] * 3)
    with pytest.raises(sa.exc.OperationalError):
        retry.until(operation, seconds=5, stop=stop, done_despite=lambda exc: False)
    assert len(calls) == 1  # stopped: no further try


def test_until_starts_no_wait_that_would_end_past_its_time() -> None:
    calls, operation = failing([lost()] * 50)
    with pytest.raises(sa.exc.OperationalError):
        retry.until(
            operation,
            seconds=0.4,
            stop=threading.Event(),
            done_despite=lambda exc: False,
        )
    # Waits of 0.05, 0.1 and 0.2 s fit in 0.4 s; the next (0.4 s) would not.
    assert len(calls) == 4
