"""Reads for /metrics and /readyz that answer within a deadline, database or not.

A scrape or a readiness check must not hang behind a database that stopped
answering (a dead proxy holds a connect for minutes), nor fail the whole
answer. Each read runs on a thread of its own and is waited for up to a
deadline; a read still running is not started again, and its result is kept
for `max_age` seconds so frequent checks cost one query.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("outbox.observability")
STUCK = 30.0  # seconds a read may run before another is started beside it
T = TypeVar("T")


@dataclass
class _Last(Generic[T]):
    value: T | None = None
    ok: bool = False
    at: float = float("-inf")


class Probe(Generic[T]):
    """One database read, answered within `deadline` seconds: its value, or None."""

    def __init__(
        self, read: Callable[[], T], *, deadline: float = 2.0, max_age: float = 1.0
    ) -> None:
        """`read` raises when the database cannot answer."""
        self._read = read
        self.deadline = deadline
        self.max_age = max_age
        self._lock = threading.Lock()
        self._last: _Last[T] = _Last()
        self._running: threading.Event | None = None
        self._running_since = 0.0

    def __call__(self) -> T | None:
        """The value of a recent read, or None when the database did not answer in time."""
        with self._lock:
            if time.monotonic() - self._last.at < self.max_age:
                return self._last.value if self._last.ok else None
            done = self._running
            # A read stuck far past its deadline (a half-open connection can hang for
            # minutes) no longer speaks for the database: start another beside it.
            stuck = done is not None and time.monotonic() - self._running_since > STUCK
            if done is None or stuck:
                done = self._running = threading.Event()
                self._running_since = time.monotonic()
                threading.Thread(
                    target=self._run, args=(done, self._running_since), daemon=True
                ).start()
        done.wait(self.deadline)
        with self._lock:
            fresh = (
                self._last.ok and time.monotonic() - self._last.at < self.deadline + self.max_age
            )
            return self._last.value if fresh else None

    def _run(self, done: threading.Event, started: float) -> None:
        last: _Last[T]
        try:
            last = _Last(self._read(), True, started)
        except Exception as exc:  # noqa: BLE001 - any failure means "not answering"
            log.warning("database read for metrics or readiness failed (%s)", exc)
            last = _Last(None, False, started)
        with self._lock:
            # Stamped with when the read began; a late answer never replaces a newer one.
            if started >= self._last.at:
                self._last = last
            if self._running is done:
                self._running = None
        done.set()
