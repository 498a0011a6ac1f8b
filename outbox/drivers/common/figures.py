"""What the relay's gauges read: messages per destination and state, and live destinations."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import state_literal
from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import FigureRow
from outbox.schema import messages, relays
from outbox.states import MessageState


def destination_figures(now: sa.ColumnElement[float]) -> Any:
    """(destination, state, count, age of the oldest) for pending, sending and dead messages.

    Dead rows give no age. One branch per state, each on that state's partial index:
    one IN over the states would read every row, delivered history included.
    """

    def per_state(state: MessageState, aged: bool) -> sa.Select[Any]:
        age = now - sa.func.min(messages.c.created_at) if aged else sa.cast(sa.null(), sa.Double())
        return (
            sa.select(
                messages.c.destination,
                state_literal(state).label("state"),
                sa.func.count().label("count"),
                age.label("age"),
            )
            .where(messages.c.state == state_literal(state))
            .group_by(messages.c.destination)
        )

    return sa.union_all(
        per_state(MessageState.PENDING, True),
        per_state(MessageState.SENDING, True),
        per_state(MessageState.DEAD, False),
    )


def live_destinations(now: sa.ColumnElement[float]) -> sa.Select[str]:
    """The destinations some relay announces and whose announcement has not lapsed."""
    return sa.select(relays.c.destination).where(relays.c.expires_at > now).distinct()


class FigureReads(DriverPieces):
    """The per-destination figures, read at a scrape."""

    def destination_figures(self, conn: Connection, now: Now) -> list[FigureRow]:
        """Pending, sending and dead messages per destination, with the undelivered' oldest age."""
        rows = conn.execute(destination_figures(self.now_sql(now)))
        return [FigureRow._make(row) for row in rows]

    def live_destinations(self, conn: Connection, now: Now) -> set[str]:
        """The destinations some relay announces and whose announcement has not lapsed."""
        return set(conn.execute(live_destinations(self.now_sql(now))).scalars())
