"""A ceiling's settings swept: batch (or parcel) size by requests in flight, the best kept.

A bare relay or publisher is the ceiling ours is held to only at its own best
settings, not at one guessed pair. Each point is measured on its own fresh
backlog; the fastest point of the run is measured once more, on a fresh backlog of
its own, and that second figure is the ceiling; the figures name its point. A
comparison takes that figure between its two drains of ours (`chosen` first, then
the winner measured there), not minutes before one of them.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One setting of a sweep: messages per batch (or parcel), and batches in flight."""

    batch: int
    in_flight: int

    @property
    def label(self) -> str:
        """The figure-name suffix of this point, e.g. 1000x8."""
        return f"{self.batch}x{self.in_flight}"


FULL = tuple(Point(batch, in_flight) for batch in (500, 1000) for in_flight in (1, 4, 8))
POINT_LABEL = re.compile(r"\d+x\d+")
QUICK = (Point(500, 1), Point(1000, 8))
"""A smoke run's sweep: two points, enough to exercise choosing the best."""


def grid(quick: bool) -> tuple[Point, ...]:
    """The points a full or a quick run sweeps."""
    return QUICK if quick else FULL


def chosen(
    name: str, points: Iterable[Point], rate: Callable[[Point], float]
) -> tuple[dict[str, float], Point]:
    """`rate` at each point, as figures `name`_<point>, and the fastest point, also named by
    the figures `name`_batch and `name`_in_flight.

    The ceiling is not among the figures: where points run close, the fastest figure is
    the luckiest of several noisy draws, and would flatter the ceiling by that luck (the
    winner's curse). Choosing the point and measuring it are kept apart: the ceiling is a
    fresh measurement of the winner (`swept`, or the comparison's own).
    """
    rates = {point: rate(point) for point in points}
    if not rates:
        raise ValueError("a sweep needs at least one point")
    winner = max(rates, key=rates.__getitem__)
    figures = {f"{name}_{point.label}": value for point, value in rates.items()}
    figures |= {f"{name}_batch": float(winner.batch), f"{name}_in_flight": float(winner.in_flight)}
    return figures, winner


def swept(name: str, points: Iterable[Point], rate: Callable[[Point], float]) -> dict[str, float]:
    """The figures of `chosen`, and the fastest point's `rate` measured again, as `name`."""
    figures, winner = chosen(name, points, rate)
    return {**figures, name: rate(winner)}


def winners(name: str, runs: Iterable[dict[str, float]]) -> str:
    """The points that won a sweep over the runs, with how often, e.g. '1000 x 8 (2 of 3 runs)'."""
    won: dict[str, int] = {}
    total = 0
    for run in runs:
        total += 1
        point = f"{run[f'{name}_batch']:,.0f} x {run[f'{name}_in_flight']:.0f}"
        won[point] = won.get(point, 0) + 1
    ranked = sorted(won.items(), key=lambda item: -item[1])
    return ", ".join(f"{point} ({count} of {total} runs)" for point, count in ranked)


def medians(name: str, runs: Iterable[dict[str, float]]) -> dict[str, float]:
    """The median over the runs of each point's figure of the sweep `name`, by point label."""
    by_point: dict[str, list[float]] = {}
    for run in runs:
        for key, value in run.items():
            label = key.removeprefix(f"{name}_")
            if label != key and POINT_LABEL.fullmatch(label):
                by_point.setdefault(label, []).append(value)
    return {label: statistics.median(values) for label, values in by_point.items()}
