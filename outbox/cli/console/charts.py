"""The overview's charts: per-minute counts of the last hour and the last day, as SVG
polylines (inline, drawn with presentation attributes: the page's policy allows no
style attributes and no script)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import sqlalchemy as sa

from outbox.db import console_sql
from outbox.db.console_sql import MINUTE
from outbox.operations import Operations

WIDTH = 480
HEIGHT = 120
SERIES = (
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
    since, until = (current - minutes + 1) * MINUTE, (current + 1) * MINUTE
    dialect = ops.engine.dialect.name
    counts: dict[str, dict[int, int]] = {}
    with ops.engine.connect() as conn:
        for series, _, _ in SERIES:
            query = console_sql.per_minute(series, since, until, dialect)
            counts[series] = {int(m): int(c) for m, c in conn.execute(query)}
    return counts


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
