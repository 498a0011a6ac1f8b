"""The overview's charts: per-minute counts of the last hour and the last day, as SVG
polylines (inline, drawn with presentation attributes: the page's policy allows no
style attributes and no script)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import sqlalchemy as sa

from outbox.drivers.base import Series
from outbox.drivers.common.console import MINUTE
from outbox.operations import Operations

WIDTH = 480
HEIGHT = 120
SERIES: tuple[tuple[Series, str, str], ...] = (
    ("enqueued", "replies enqueued", "#4063d8"),
    ("sent", "replies sent", "#2e8b57"),
    ("dead", "replies dead", "#c0392b"),
    ("finished", "tasks finished", "#8e44ad"),
)
"""(series, label, colour) in drawing order."""
WINDOWS = (("last hour", 60), ("last day", 1440))
"""(title, minutes) of each chart."""
LONGEST = max(minutes for _, minutes in WINDOWS)


@dataclass(frozen=True)
class Line:
    """One series of a chart: its polyline's points, its total and its busiest minute."""

    label: str
    colour: str
    points: str
    total: int
    peak: int


@dataclass(frozen=True)
class Chart:
    """One window's chart."""

    title: str
    minutes: int
    lines: tuple[Line, ...]
    peak: int


def minute_counts(ops: Operations, now: float, minutes: int) -> dict[str, dict[int, int]]:
    """Per series, the count of each minute of the `minutes` before the current one."""
    current = math.floor(now / MINUTE)
    return _read(ops, [series for series, _, _ in SERIES], current - minutes + 1, current + 1)


def _read(ops: Operations, series: list[Series], first: int, end: int) -> dict[str, dict[int, int]]:
    """Per series, the count of each minute in [first, end) (minute numbers)."""
    counts: dict[str, dict[int, int]] = {}
    with ops.engine.connect() as conn:
        for each in series:
            counts[each] = ops.driver.per_minute(conn, each, first * MINUTE, end * MINUTE)
    return counts


SETTLED_AFTER = 5
"""Minutes after which a minute's counts of enqueued, sent and finished no longer change:
each timestamp is written as it happens (a transaction may commit a little later)."""
REREAD_AFTER = 60
"""Minutes after which every count is read again (a purge may delete rows of a past minute)."""
ALWAYS_READ: frozenset[Series] = frozenset({"dead"})
"""Series read whole each time: a requeue takes a row out of a past minute (and the dead
are few: their partial index answers at once)."""


@dataclass
class SettledCounts:
    """Per-minute counts that keep the settled minutes, so that an overview reads only the
    last few minutes of the busy series, not a whole day of history each time."""

    _counts: dict[str, dict[int, int]] = field(default_factory=dict)
    _settled_until: int | None = None
    _read_at: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def counts(self, ops: Operations, now: float, minutes: int) -> dict[str, dict[int, int]]:
        """Per series, the count of each minute of the `minutes` before the current one."""
        current = math.floor(now / MINUTE)
        first, end = current - minutes + 1, current + 1
        busy = [series for series, _, _ in SERIES if series not in ALWAYS_READ]
        with self._lock:
            kept = self._settled_until
            if kept is None or kept < first or current - self._read_at >= REREAD_AFTER:
                kept, self._counts, self._read_at = first, {}, current
            fresh = _read(ops, busy, kept, end)
            fresh.update(_read(ops, sorted(ALWAYS_READ), first, end))
            settled = current - SETTLED_AFTER + 1
            for series in busy:
                merged = {m: c for m, c in self._counts.get(series, {}).items() if m >= first}
                merged.update(fresh[series])
                self._counts[series] = {m: c for m, c in merged.items() if m < settled}
                fresh[series] = merged
            self._settled_until = max(settled, first)
            return fresh


def charts(counts: dict[str, dict[int, int]], now: float) -> tuple[Chart, ...]:
    """The charts of each window from the day's per-minute counts."""
    current = math.floor(now / MINUTE)
    drawn = []
    for title, minutes in WINDOWS:
        first = current - minutes + 1
        values = {
            series: [counts[series].get(first + i, 0) for i in range(minutes)]
            for series, _, _ in SERIES
        }
        peak = max(1, *(max(v) for v in values.values()))
        lines = tuple(
            Line(
                label,
                colour,
                _points(values[series], peak),
                sum(values[series]),
                max(values[series]),
            )
            for series, label, colour in SERIES
        )
        drawn.append(Chart(title, minutes, lines, peak))
    return tuple(drawn)


def _points(values: list[int], peak: int) -> str:
    """A polyline's points: minutes left to right, counts bottom to top."""
    step = WIDTH / max(1, len(values) - 1)
    return " ".join(
        f"{i * step:.1f},{HEIGHT - value / peak * HEIGHT:.1f}" for i, value in enumerate(values)
    )


def database_now(ops: Operations) -> float:
    """The database's time (or a test's manual clock), which every age is measured against."""
    from outbox.db.dialect import now_expression

    with ops.engine.connect() as conn:
        now = conn.execute(sa.select(now_expression(ops.clock, ops.engine.dialect.name)))
        return float(now.scalar_one())
