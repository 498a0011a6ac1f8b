"""The overview's charts: per-minute counts of the last hour and the last day, as SVG
polylines (inline, drawn with presentation attributes: the page's policy allows no
style attributes and no script)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import sqlalchemy as sa

from outbox.drivers.common.console import MINUTE, PER_DESTINATION
from outbox.drivers.console_interface import Series
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
TICK_EVERY = {60: 10, 1440: 180}
"""Minutes between the time axis's marks, per window."""
SPAN_MINUTES = {60: 1, 1440: 10}
"""Minutes each hover span of a window sums: a day's minutes would be 1,440 titles."""
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
class Tick:
    """A mark on a chart's time axis: where, and the UTC time it stands for."""

    x: float
    label: str


@dataclass(frozen=True)
class Span:
    """A stretch of a chart that shows its values on hover (an SVG title)."""

    x: float
    width: float
    title: str


@dataclass(frozen=True)
class Chart:
    """One window's chart: its lines, its time axis, and its hover spans."""

    title: str
    minutes: int
    lines: tuple[Line, ...]
    peak: int
    ticks: tuple[Tick, ...] = ()
    spans: tuple[Span, ...] = ()


def charted(destination: str | None) -> list[Series]:
    """The series drawn: all, or a destination's (tasks have none)."""
    return [s for s, _, _ in SERIES if destination is None or s in PER_DESTINATION]


def minute_counts(
    ops: Operations, now: float, minutes: int, destination: str | None = None
) -> dict[str, dict[int, int]]:
    """Per series, the count of each minute of the `minutes` before the current one."""
    current = math.floor(now / MINUTE)
    first, end = current - minutes + 1, current + 1
    return _read(ops, charted(destination), first, end, destination)


def _read(
    ops: Operations, series: list[Series], first: int, end: int, destination: str | None
) -> dict[str, dict[int, int]]:
    """Per series, the count of each minute in [first, end) (minute numbers)."""
    counts: dict[str, dict[int, int]] = {}
    with ops.engine.connect() as conn:
        for each in series:
            since, until = first * MINUTE, end * MINUTE
            counts[each] = ops.driver.per_minute(conn, each, since, until, destination)
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
    """Per-minute counts (and the relays' samples of the oldest undelivered age) that keep
    the settled minutes, so that an overview reads only the last few minutes, not a whole
    day each time; of one destination's messages if `destination` is set."""

    destination: str | None = None
    _counts: dict[str, dict[int, int]] = field(default_factory=dict)
    _settled_until: int | None = None
    _read_at: int = 0
    _ages: dict[int, float] = field(default_factory=dict)
    _ages_until: int | None = None
    _ages_read_at: int = 0
    _ages_from: int = 0
    """The first minute the kept ages were read from: a wider window reads them all again."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def counts(self, ops: Operations, now: float, minutes: int) -> dict[str, dict[int, int]]:
        """Per series, the count of each minute of the `minutes` before the current one."""
        current = math.floor(now / MINUTE)
        first, end = current - minutes + 1, current + 1
        drawn = charted(self.destination)
        busy = [series for series in drawn if series not in ALWAYS_READ]
        whole = [series for series in drawn if series in ALWAYS_READ]
        with self._lock:
            kept = self._settled_until
            if kept is None or kept < first or current - self._read_at >= REREAD_AFTER:
                kept, self._counts, self._read_at = first, {}, current
            fresh = _read(ops, busy, kept, end, self.destination)
            fresh.update(_read(ops, whole, first, end, self.destination))
            settled = current - SETTLED_AFTER + 1
            for series in busy:
                merged = {m: c for m, c in self._counts.get(series, {}).items() if m >= first}
                merged.update(fresh[series])
                self._counts[series] = {m: c for m, c in merged.items() if m < settled}
                fresh[series] = merged
            self._settled_until = max(settled, first)
            return fresh

    def oldest(self, ops: Operations, now: float, minutes: int) -> dict[int, float]:
        """Minute number -> the oldest undelivered age the relays sampled then, over the
        `minutes` before the current one (of the destination, or the greatest of all);
        settled minutes kept, as the counts are."""
        current = math.floor(now / MINUTE)
        first, end = current - minutes + 1, current + 1
        settled = current - SETTLED_AFTER + 1
        with self._lock:
            kept = self._ages_until
            stale = current - self._ages_read_at >= REREAD_AFTER
            if kept is None or kept < first or first < self._ages_from or stale:
                kept, self._ages, self._ages_read_at, self._ages_from = first, {}, current, first
            with ops.engine.connect() as conn:
                read = ops.driver.oldest_ages(conn, kept * MINUTE, end * MINUTE, self.destination)
            fresh = {round(start / MINUTE): age for start, age in read.items()}
            merged = {m: a for m, a in self._ages.items() if m >= first} | fresh
            self._ages = {m: a for m, a in merged.items() if m < settled}
            self._ages_until = max(settled, first)
            return merged


def charts(counts: dict[str, dict[int, int]], now: float) -> tuple[Chart, ...]:
    """The charts of each window from the day's per-minute counts."""
    current = math.floor(now / MINUTE)
    drawn = []
    for title, minutes in WINDOWS:
        first = current - minutes + 1
        # The series counted: all, or a destination's (tasks have none).
        shown = [(series, label, colour) for series, label, colour in SERIES if series in counts]
        values: dict[Series, list[int]] = {
            series: [counts[series].get(first + i, 0) for i in range(minutes)]
            for series, _, _ in shown
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
            for series, label, colour in shown
        )
        ticks = time_axis(first, minutes)
        spans = _spans(first, minutes, values)
        drawn.append(Chart(title, minutes, lines, peak, ticks, spans))
    return tuple(drawn)


def x_of(index: int, minutes: int) -> float:
    """Where minute `index` of a window of `minutes` is drawn."""
    return index * WIDTH / max(1, minutes - 1)


def time_axis(first: int, minutes: int) -> tuple[Tick, ...]:
    """The time axis: a mark at each whole TICK_EVERY minutes of the window, in UTC."""
    every = TICK_EVERY[minutes]
    return tuple(
        Tick(round(x_of(i, minutes), 1), clock_time(first + i))
        for i in range(minutes)
        if (first + i) % every == 0
    )


def _spans(first: int, minutes: int, values: dict[Series, list[int]]) -> tuple[Span, ...]:
    """Hover spans of SPAN_MINUTES each: their time and every series' count over it."""
    size = SPAN_MINUTES[minutes]
    step = WIDTH / minutes * size
    spans = []
    for start in range(0, minutes, size):
        counts = ", ".join(
            f"{label} {sum(values[series][start : start + size])}"
            for series, label, _ in SERIES
            if series in values
        )
        when = clock_time(first + start)
        if size > 1:
            when += f"-{clock_time(first + start + size)}"
        spans.append(Span(round(start / size * step, 1), round(step, 1), f"{when} UTC: {counts}"))
    return tuple(spans)


def clock_time(minute: int) -> str:
    """A minute number as its UTC time of day, HH:MM."""
    of_day = minute % (24 * 60)
    return f"{of_day // 60:02d}:{of_day % 60:02d}"


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
