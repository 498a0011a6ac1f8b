"""What the relay's gauges show of the database: per destination, and what no relay routes.

Read at scrape time (relay.metrics) from one grouped statement over the
undelivered and dead messages (the driver's destination_figures) and the
destinations live relays announce; the arithmetic here needs no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from outbox.states import MessageState

UNDELIVERED = (MessageState.PENDING, MessageState.SENDING)


@dataclass(frozen=True)
class DestinationFigures:
    """One destination's messages: undelivered (pending or sending), dead, and the oldest's age."""

    backlog: int = 0
    dead: int = 0
    oldest_age: float | None = None
    """Seconds since the oldest undelivered message was created; None when there is none."""


@dataclass(frozen=True)
class Figures:
    """Every destination with messages (and every configured one), and the unrouted total."""

    destinations: dict[str, DestinationFigures]
    unrouted: int
    unrouted_oldest_age: float | None


def _older(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def figures_from(
    rows: Iterable[Any], routed: Collection[str], configured: Iterable[str]
) -> Figures:
    """Figures from (destination, state, count, age) rows and the destinations live relays
    announce; `configured` destinations appear even without messages."""
    found: dict[str, DestinationFigures] = {name: DestinationFigures() for name in configured}
    unrouted, unrouted_age = 0, None
    for destination, state, count, age in rows:
        known = found.get(destination, DestinationFigures())
        count = int(count)
        age = None if age is None else float(age)
        if state in UNDELIVERED:
            known = DestinationFigures(
                known.backlog + count, known.dead, _older(known.oldest_age, age)
            )
        elif state == MessageState.DEAD:
            known = DestinationFigures(known.backlog, known.dead + count, known.oldest_age)
        found[destination] = known
        if state == MessageState.PENDING and destination not in routed:
            unrouted += count
            unrouted_age = _older(unrouted_age, age)
    return Figures(found, unrouted, unrouted_age)
