"""Transient database errors: one classification, and the retry policies built on it.

A transient error is one a second try on a fresh connection may well pass: a
lost or invalidated connection, a serialization failure or deadlock, a server
shutting down, SQLite busy or locked. Everything else (a constraint, a bad
statement) fails the same way again and is raised at once. Which codes are which is
each backend's driver's to say (outbox.drivers.errors).

Retrying after a COMMIT whose outcome is unknown is only safe where the caller
resolves that doubt: the worker and the relay re-read the rows, the receiver's
receipt makes the second try a duplicate.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential,
    wait_random,
)

from outbox.drivers import DRIVERS

T = TypeVar("T")
# Statements retried in-process by the relay: a few quick tries, then the turn fails.
QUICK_TRIES = 6
# Backoff between attempts to write a worker's outcome while the database is away.
FIRST_WAIT = 0.05
LONGEST_WAIT = 1.0


def is_transient(exc: BaseException) -> bool:
    """Database errors worth retrying: lost connections, and what the backend's driver
    calls transient (serialization failures, deadlocks, SQLite busy)."""
    if not isinstance(exc, sa.exc.DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    for driver in DRIVERS.values():
        verdict = driver.transient(exc.orig)
        if verdict is not None:
            return verdict
    return isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError)


def refused_statement(exc: BaseException) -> bool:
    """The server refused the statement itself, though the DBAPI may call it operational."""
    orig = getattr(exc, "orig", None)
    return any(driver.refused_statement(orig) for driver in DRIVERS.values())


def waited_for_lock(exc: BaseException) -> bool:
    """A lock wait the server already bounded (SQLite busy): another try would wait again."""
    orig = getattr(exc, "orig", None)
    return any(driver.waited_for_lock(orig) for driver in DRIVERS.values())


def quickly(
    operation: Callable[[], T],
    *,
    retry_if: Callable[[BaseException], bool] = is_transient,
    tries: int = QUICK_TRIES,
) -> T:
    """Run `operation`, trying again (jittered, under 2 s apart) while `retry_if(error)`.

    By default an error is worth another try when it is transient; a caller that
    knows more (a race a second try wins, a wait already spent) says so.
    """
    # The first try runs bare: it is the common case, on hot paths, and succeeds.
    try:
        return operation()
    except Exception as exc:
        if tries <= 1 or not retry_if(exc):
            raise
    time.sleep(FIRST_WAIT + random.uniform(0, FIRST_WAIT))
    for attempt in Retrying(
        retry=retry_if_exception(retry_if),
        stop=stop_after_attempt(tries - 1),
        wait=wait_exponential(multiplier=2 * FIRST_WAIT, max=2.0) + wait_random(0, FIRST_WAIT),
        reraise=True,
    ):
        with attempt:
            return operation()
    raise AssertionError("unreachable")  # pragma: no cover


def until(
    operation: Callable[[], T],
    *,
    seconds: float,
    stop: threading.Event,
    done_despite: Callable[[BaseException], bool],
    on_retry: Callable[[BaseException], None] = lambda exc: None,
) -> T | None:
    """Run `operation`, trying again while its error is transient, for at most `seconds`.

    Waits double from FIRST_WAIT to LONGEST_WAIT; no wait starts that would end
    past `seconds`, and once `stop` is set no further try starts. After a
    transient error `done_despite(error)` is asked whether the work was done
    anyway (a COMMIT whose answer was lost): then None is returned instead of
    trying again. The last error is raised as it is.
    """
    started = time.monotonic()
    # The first try runs bare: it is the common case, once per task, and succeeds.
    try:
        return operation()
    except Exception as exc:
        if not is_transient(exc):
            raise
        if done_despite(exc):
            return None
        failed: list[BaseException] = [exc]
    left = seconds - (time.monotonic() - started) - FIRST_WAIT
    if left <= 0 or stop.is_set():
        raise failed[-1]
    on_retry(failed[-1])
    if stop.wait(FIRST_WAIT):
        raise failed[-1]  # told to stop during the wait: no further write

    def once() -> T | None:
        if stop.is_set():
            raise failed[-1]  # told to stop during the wait: no further write
        try:
            return operation()
        except Exception as exc:
            if is_transient(exc) and done_despite(exc):
                return None
            failed.append(exc)
            raise

    def give_up(state: RetryCallState) -> bool:
        return stop.is_set() or bool(stop_before_delay(left)(state))

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is not None:
            on_retry(exc)

    def pause(seconds: float) -> None:
        stop.wait(seconds)

    for attempt in Retrying(
        retry=retry_if_exception(is_transient),
        stop=give_up,
        wait=wait_exponential(multiplier=2 * FIRST_WAIT, max=LONGEST_WAIT),
        sleep=pause,
        before_sleep=before_sleep,
        reraise=True,
    ):
        with attempt:
            return once()
    raise AssertionError("unreachable")  # pragma: no cover
