"""The overview's health rows: each destination judged healthy, degraded, failing or
unrouted from its backlog, its oldest undelivered message, its dead of the last hour and
the live relays' last answers; and the relays and workers, live or lapsed. No I/O here:
console.reads gathers the rows, this module judges them (docs/how-to/operations.md, "The
overview's health rows", says how).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from outbox.drivers.common.announcements import LAPSED_KEPT
from outbox.drivers.records import RelayRow, WorkerRow
from outbox_cli.arguments import age_text
from relay.figures import DestinationFigures

Row = TypeVar("Row", RelayRow, WorkerRow)
HealthState = Literal["failing", "unrouted", "degraded", "healthy"]
STATES: tuple[HealthState, ...] = ("failing", "unrouted", "degraded", "healthy")
"""The states, worst first: the overview lists destinations in this order."""
HOUR = 3600.0
RECENT = HOUR
"""A failure or a death this recent makes a destination degraded at least."""
STALE_AFTER = 300.0
"""Seconds the oldest undelivered message may wait before its destination is degraded: a
destination that keeps up delivers within seconds, so five minutes is a backlog stuck."""


@dataclass(frozen=True)
class LastAnswer:
    """The live relays' last answers from one destination, merged: the latest of each."""

    sent_at: float | None = None
    failed_at: float | None = None
    status: int | None = None
    error: str | None = None

    def failed_last(self) -> bool:
        """Whether the latest answer is a failure (a delivery at the same moment is not)."""
        if self.failed_at is None:
            return False
        return self.sent_at is None or self.failed_at > self.sent_at


@dataclass(frozen=True)
class DestinationHealth:
    """One row of the overview's health table."""

    name: str
    state: HealthState
    why: str
    """The reasons for the state, in words."""
    figures: DestinationFigures
    dead_last_hour: int
    answer: LastAnswer
    relays: int
    """How many live relays deliver it."""


@dataclass(frozen=True)
class Announced:
    """A relay or a worker as the overview lists it."""

    owner: str
    what: str
    """The destinations a relay delivers; a worker's handler and slots."""
    heard_at: float | None
    """Its last announcement (None: a relay older than the console's health rows)."""
    heard_age: float | None
    """Seconds since then, never below 0 (an announcement may land after `now` was read)."""
    live: bool
    lapsed_age: float | None
    """Seconds since its announcement lapsed (None while live)."""


def merged_answers(rows: Iterable[RelayRow]) -> dict[str, LastAnswer]:
    """Per destination, the latest delivery and the latest failure any relay reports, lapsed
    ones kept included: their times are the database's, so they compare, and a relay that
    restarted under a new name must not make a destination that is down look healthy."""
    merged: dict[str, LastAnswer] = {}
    for row in rows:
        known = merged.get(row.destination, LastAnswer())
        sent_at = _latest(known.sent_at, row.last_sent_at)
        if row.last_failed_at is not None and (
            known.failed_at is None or row.last_failed_at > known.failed_at
        ):
            known = LastAnswer(sent_at, row.last_failed_at, row.last_status, row.last_error)
        else:
            known = LastAnswer(sent_at, known.failed_at, known.status, known.error)
        merged[row.destination] = known
    return merged


def judge(
    figures: DestinationFigures, dead_last_hour: int, answer: LastAnswer, relays: int, now: float
) -> tuple[HealthState, str]:
    """A destination's state and why, worst first: failing (its last answer failed and
    replies still wait, or it failed within the hour), unrouted (no live relay delivers
    it), degraded (dead within the hour, the oldest undelivered waiting over STALE_AFTER,
    or a failure within the hour though deliveries go on), else healthy."""
    failure = answer.failed_at
    recent_failure = failure is not None and now - failure <= RECENT
    if relays and answer.failed_last() and (figures.backlog or recent_failure):
        return "failing", _failing_why(answer, now)
    if not relays:
        waiting = f"; {figures.backlog} waiting" if figures.backlog else ""
        return "unrouted", f"no live relay delivers it{waiting}"
    reasons = []
    if dead_last_hour:
        reasons.append(f"{dead_last_hour} dead in the last hour")
    if figures.oldest_age is not None and figures.oldest_age > STALE_AFTER:
        reasons.append(f"oldest undelivered waiting {age_text(figures.oldest_age)}")
    if recent_failure and failure is not None:
        reasons.append(f"an attempt failed {_ago(failure, now)}")
    if reasons:
        return "degraded", "; ".join(reasons)
    return "healthy", _accepted(answer, now)


def _failing_why(answer: LastAnswer, now: float) -> str:
    """Why a failing destination is failing, in words."""
    failed = "no answer" if answer.status is None else f"status {answer.status}"
    failed_at = now if answer.failed_at is None else answer.failed_at
    return f"last attempt failed ({failed}) {_ago(failed_at, now)}; {_accepted(answer, now)}"


def _accepted(answer: LastAnswer, now: float) -> str:
    """When a delivery to the destination was last accepted, in words."""
    if answer.sent_at is None:
        return "no delivery accepted since its relays started"
    return f"last delivery accepted {_ago(answer.sent_at, now)}"


def _ago(moment: float, now: float) -> str:
    """How long before `now` `moment` was, in words ("3s ago")."""
    return f"{age_text(max(now - moment, 0.0))} ago"


def destination_health(
    figures: Mapping[str, DestinationFigures],
    dead_last_hour: Mapping[str, int],
    relay_rows: Iterable[RelayRow],
    now: float,
) -> list[DestinationHealth]:
    """A row per destination with replies waiting, dead within the hour, or an announcement
    (lapsed ones kept included), worst state first, then by name."""
    rows = kept(relay_rows, now)
    answers = merged_answers(rows)
    relays: dict[str, int] = defaultdict(int)
    for row in rows:
        if row.expires_at > now:
            relays[row.destination] += 1
    # Listed: what waits, what died within the hour, and what a relay announces or did
    # (its rows are kept an hour after they lapse). Dead replies of a destination no relay
    # has delivered for an hour are the dead list's, not a health row's.
    waiting = {name for name, figure in figures.items() if figure.backlog}
    names = waiting | {row.destination for row in rows} | set(dead_last_hour)
    health = []
    for name in names:
        figure = figures.get(name, DestinationFigures())
        answer = answers.get(name, LastAnswer())
        dead = dead_last_hour.get(name, 0)
        state, why = judge(figure, dead, answer, relays[name], now)
        health.append(DestinationHealth(name, state, why, figure, dead, answer, relays[name]))
    return sorted(health, key=lambda row: (STATES.index(row.state), row.name))


def kept(rows: Iterable[Row], now: float) -> list[Row]:
    """The announcements live, or lapsed within LAPSED_KEPT: older ones wait only for the
    next announcement to delete them, which may be long in coming with no relay running."""
    return [row for row in rows if row.expires_at > now - LAPSED_KEPT]


def relays_announced(rows: Iterable[RelayRow], now: float) -> list[Announced]:
    """Each relay once, with the destinations it announces: live ones first, then by name."""
    by_owner: dict[str, list[RelayRow]] = defaultdict(list)
    for row in kept(rows, now):
        by_owner[row.owner].append(row)
    listed = []
    for owner, own in by_owner.items():
        expires = max(row.expires_at for row in own)
        heard = [row.announced_at for row in own if row.announced_at is not None]
        destinations = ", ".join(sorted(row.destination for row in own))
        listed.append(_announced(owner, destinations, max(heard, default=None), expires, now))
    return sorted(listed, key=lambda one: (not one.live, one.owner))


def workers_announced(rows: Iterable[WorkerRow], now: float) -> list[Announced]:
    """Each worker, with its handler and slots: live ones first, then by name."""
    listed = [
        _announced(
            row.owner,
            f"{row.handler} ({row.concurrency} slots)",
            row.announced_at,
            row.expires_at,
            now,
        )
        for row in kept(rows, now)
    ]
    return sorted(listed, key=lambda one: (not one.live, one.owner))


def _announced(
    owner: str, what: str, heard_at: float | None, expires_at: float, now: float
) -> Announced:
    live = expires_at > now
    heard_age = None if heard_at is None else max(now - heard_at, 0.0)
    return Announced(owner, what, heard_at, heard_age, live, None if live else now - expires_at)


def _latest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
