"""Each destination's backlog sampled once a minute, and read back for the console's chart
of the oldest undelivered message's age over time.

A minute's samples are written once, by the first relay to take them: the minute is the
database's (a manual clock's), and a relay that finds the minute sampled reads nothing
more. Older samples than SAMPLES_KEPT are deleted as new ones are written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.console import MINUTE
from outbox.drivers.common.figures import destination_figures
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import FigureRow
from outbox.schema import backlog_samples
from outbox.states import MessageState

SAMPLES_KEPT = 2 * 86_400.0
"""Seconds of samples kept: the console's longest chart is a day."""
UNDELIVERED = frozenset({MessageState.PENDING.value, MessageState.SENDING.value})


def this_minute(pieces: DriverPieces, now: sa.ColumnElement[float]) -> sa.Select[int, bool]:
    """The start of the current minute, and whether it is sampled already."""
    minute = pieces.floor(now / MINUTE) * MINUTE
    taken = sa.exists().where(backlog_samples.c.sampled_at == minute)
    return sa.select(minute, taken)


def sample_rows(
    figures: Sequence[FigureRow], destinations: Sequence[str], minute: float
) -> list[dict[str, Any]]:
    """A sample per destination with undelivered messages, and per one of `destinations`
    (a backlog of 0, no age, when it has none)."""
    backlog = dict.fromkeys(destinations, 0)
    oldest: dict[str, float] = {}
    for figure in figures:
        if figure.state not in UNDELIVERED:
            continue
        backlog[figure.destination] = backlog.get(figure.destination, 0) + figure.number
        if figure.age is not None:
            oldest[figure.destination] = max(figure.age, oldest.get(figure.destination, 0.0))
    # In destination order: two relays writing one minute at once take its keys in the
    # same order, so neither waits on the other in a circle.
    return [
        {
            "sampled_at": minute,
            "destination": name,
            "backlog": count,
            "oldest_age": oldest.get(name),
        }
        for name, count in sorted(backlog.items())
    ]


def select_oldest_ages(since: float, until: float, destination: str | None) -> sa.Select[Any]:
    """(minute start, the oldest age sampled that minute: of `destination`, or the greatest
    of every destination's) for the minutes in [since, until), along the primary key.

    A minute some relay sampled has a row for every destination with undelivered messages:
    one it has no row for had none waiting (0), not a gap.
    """
    window = [
        backlog_samples.c.sampled_at >= sa.bindparam("since", since, type_=sa.Double()),
        backlog_samples.c.sampled_at < sa.bindparam("until", until, type_=sa.Double()),
    ]
    age: sa.ColumnElement[float] = sa.func.coalesce(backlog_samples.c.oldest_age, 0.0)
    if destination is not None:
        mine = backlog_samples.c.destination == sa.bindparam("destination", destination)
        age = sa.case((mine, age), else_=0.0)
    return (
        sa.select(backlog_samples.c.sampled_at, sa.func.max(age))
        .where(*window)
        .group_by(backlog_samples.c.sampled_at)
    )


class BacklogSampleStatements(DriverPieces):
    """Sampling each destination's backlog once a minute, and reading the samples back."""

    def backlog_sample(
        self, conn: Connection, now: Now, destinations: Sequence[str]
    ) -> list[dict[str, Any]]:
        """This minute's sample rows (every destination with undelivered messages, and
        each of `destinations`, sorted by destination), or none when some relay has
        sampled the minute already. Reads only: record_backlog_sample writes them."""
        moment = self.now_sql(now)
        minute, taken = conn.execute(this_minute(self, moment)).one()
        if taken:
            return []
        figures = [FigureRow._make(row) for row in conn.execute(destination_figures(moment))]
        return sample_rows(figures, destinations, float(minute))

    def record_backlog_sample(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Write a minute's sample rows (another relay's of the same minute win), and delete
        the samples older than SAMPLES_KEPT."""
        if not rows:
            return
        conn.execute(self.insert_ignoring_conflicts(backlog_samples), list(rows))
        expired = backlog_samples.c.sampled_at < rows[0]["sampled_at"] - SAMPLES_KEPT
        conn.execute(backlog_samples.delete().where(expired))

    def oldest_ages(
        self, conn: Connection, since: float, until: float, destination: str | None = None
    ) -> dict[float, float]:
        """Minute start -> the oldest undelivered age sampled then (of `destination`, or the
        greatest of all), for the sampled minutes in [since, until)."""
        rows = conn.execute(select_oldest_ages(since, until, destination))
        return {float(minute): float(age) for minute, age in rows}
