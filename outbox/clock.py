"""Time: the database's clock by default, a manual clock in tests (outbox.testing).

Every lease, deadline and backoff comparison is made against one "now" per
statement. With the default clock that "now" is computed by the database, so
workers with skewed clocks still agree; a ManualClock makes it a bound value.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """A callable returning epoch seconds."""

    def __call__(self) -> float:
        """Current time in epoch seconds."""
        ...


class ManualClock:
    """A clock that moves only when told to; thread-safe."""

    def __init__(self, start: float = 0.0) -> None:
        """Start at `start` epoch seconds."""
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        """The current manual time."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by `seconds` (never backwards) and return the new time."""
        if seconds < 0:
            raise ValueError("a clock never goes back")
        with self._lock:
            self._now += seconds
            return self._now

    def __repr__(self) -> str:
        return f"ManualClock({self():.3f})"
