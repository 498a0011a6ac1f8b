"""Time: the database's clock by default, a manual clock in tests.

Every lease, deadline and backoff comparison is made against one "now" per
statement. With the default clock that "now" is computed by the database, so
workers with skewed clocks still agree; a ManualClock makes it a bound value.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.sql.elements import ColumnElement


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


def database_now(dialect_name: str) -> ColumnElement[float]:
    """SQL for the database's current time in epoch seconds."""
    if dialect_name == "postgresql":
        # Statement time: stable within a statement (so indexes can use it) but current,
        # unlike now(), which would freeze at the start of a caller's long transaction.
        return sa.literal_column("extract(epoch from statement_timestamp())::float8", sa.Double())
    if dialect_name == "sqlite":
        return sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)", sa.Double())
    raise ValueError(f"unsupported database dialect {dialect_name!r}")


def now_expression(clock: Clock | None, dialect_name: str) -> ColumnElement[float]:
    """The "now" to put in a statement: a bound manual time or the database clock."""
    if clock is None:
        return database_now(dialect_name)
    return sa.literal(float(clock()), sa.Double())


def bound_now(dialect_name: str) -> ColumnElement[float]:
    """The "now" of a statement built once: bind `now` to a manual time, or None (database)."""
    # Read in the statement either way: no extra round trip for the database's clock.
    return sa.func.coalesce(sa.bindparam("now", type_=sa.Double()), database_now(dialect_name))
