"""The overview's chart of the oldest undelivered reply's age over time, from the relays'
samples (one a minute per destination, outbox.drivers.common.backlog_samples).

A minute no relay sampled is a gap in the line, not a zero: with no relay running, no
one measured, and a zero would read as "nothing waiting".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from outbox.drivers.common.console import MINUTE
from outbox_cli.arguments import age_text
from outbox_cli.console.charts import (
    HEIGHT,
    SPAN_MINUTES,
    WIDTH,
    WINDOWS,
    Span,
    Tick,
    clock_time,
    time_axis,
    x_of,
)

COLOUR = "#b35c00"
LABEL = "oldest undelivered"


@dataclass(frozen=True)
class AgeChart:
    """One window's chart of the oldest undelivered age: its path (one stretch per run of
    sampled minutes), its highest age, how many minutes were sampled, its axis and spans."""

    title: str
    minutes: int
    path: str
    peak: float
    peak_text: str
    sampled: int
    ticks: tuple[Tick, ...]
    spans: tuple[Span, ...]


def age_charts(ages: dict[int, float], now: float) -> tuple[AgeChart, ...]:
    """The age chart of each window from the sampled minutes."""
    current = math.floor(now / MINUTE)
    drawn = []
    for title, minutes in WINDOWS:
        first = current - minutes + 1
        values = [ages.get(first + i) for i in range(minutes)]
        highest = max((v for v in values if v is not None), default=None)
        peak = max(1.0, highest or 0.0)
        sampled = sum(v is not None for v in values)
        drawn.append(
            AgeChart(
                title,
                minutes,
                _path(values, peak),
                peak,
                age_text(highest),
                sampled,
                time_axis(first, minutes),
                _spans(first, minutes, values),
            )
        )
    return tuple(drawn)


def _path(values: list[float | None], peak: float) -> str:
    """An SVG path: a stretch per run of sampled minutes (a lone minute a short one, which
    the round line cap shows as a dot)."""
    parts = []
    drawing = False
    for i, value in enumerate(values):
        if value is None:
            drawing = False
            continue
        command = "L" if drawing else "M"
        x, y = x_of(i, len(values)), HEIGHT - value / peak * HEIGHT
        parts.append(f"{command}{x:.1f},{y:.1f}")
        if not drawing:
            # A zero-length stretch draws nothing: a lone sample gets a short one.
            parts.append("h0.1")
        drawing = True
    return " ".join(parts)


def _spans(first: int, minutes: int, values: list[float | None]) -> tuple[Span, ...]:
    """Hover spans of SPAN_MINUTES each: their time and the highest age sampled in them."""
    size = SPAN_MINUTES[minutes]
    step = WIDTH / minutes * size
    spans = []
    for start in range(0, minutes, size):
        sampled = [v for v in values[start : start + size] if v is not None]
        said = f"{LABEL} {age_text(max(sampled))}" if sampled else "not sampled (no relay ran)"
        when = clock_time(first + start)
        if size > 1:
            when += f"-{clock_time(first + start + size)}"
        spans.append(Span(round(start / size * step, 1), round(step, 1), f"{when} UTC: {said}"))
    return tuple(spans)
