"""Outbox messages in portable Core: publish, and reading them back."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox.drivers.base import Now, Unrouted
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import messages, relays
from outbox.states import MessageState


def message_values(statement: Any, now: sa.ColumnElement[float]) -> Any:
    """An INSERT of outbox messages as pending and due `now`."""
    return statement.values(
        state=MessageState.PENDING.value, attempts=0, fence=0, available_at=now, created_at=now
    )


def select_message(reply_id: str) -> sa.Select[Any]:
    """One message row by reply_id."""
    return sa.select(messages).where(messages.c.reply_id == reply_id)


def select_messages(state: str | None, limit: int | None) -> sa.Select[Any]:
    """Messages in sequence order, optionally of one state, at most `limit` of them."""
    query = sa.select(messages).order_by(messages.c.id)
    if state is not None:
        query = query.where(messages.c.state == state)
    if limit is not None:
        query = query.limit(limit)
    return query


def unrouted(now: sa.ColumnElement[float]) -> sa.Select[int, float]:
    """How many pending messages no live relay delivers, and the age of the oldest.

    A relay announces its destinations in outbox_relays until its announcement
    expires; a destination no live announcement names is unrouted.
    """
    # NOT IN over the (few) live destinations: PostgreSQL hashes them once and SQLite
    # builds one ephemeral index, instead of a correlated probe per pending row.
    routed = sa.select(relays.c.destination).where(relays.c.expires_at > now)
    return sa.select(sa.func.count(), now - sa.func.min(messages.c.created_at)).where(
        messages.c.state == MessageState.PENDING.value, messages.c.destination.not_in(routed)
    )


class MessageStatements(DriverPieces):
    """Messages: the insert publish() runs, and the reads."""

    @cached_property
    def insert_one_message(self) -> Any:
        """INSERT one message unless its reply_id exists, RETURNING the row; built once.

        Bind `now` to a manual clock's time, or None for the database's clock.
        """
        statement = self.insert_ignoring_conflicts(messages)
        return message_values(statement, self.bound_now()).returning(*messages.c)

    def insert_message(self, conn: Connection, row: dict[str, Any], now: Now) -> RowMapping | None:
        """Insert one message as pending and due now unless its reply_id exists: the new
        row, or None when it existed."""
        return conn.execute(self.insert_one_message, {**row, "now": now}).mappings().first()

    def message(self, conn: Connection, reply_id: str) -> RowMapping | None:
        """One message row by reply_id, or None."""
        return conn.execute(select_message(reply_id)).mappings().first()

    def messages_in_order(
        self, conn: Connection, state: str | None, limit: int | None
    ) -> list[RowMapping]:
        """Messages in sequence order, optionally of one state, at most `limit` of them."""
        return list(conn.execute(select_messages(state, limit)).mappings())

    def unrouted(self, conn: Connection, now: Now) -> Unrouted:
        """Pending messages whose destination no live relay announces."""
        count, age = conn.execute(unrouted(self.now_sql(now))).one()
        return Unrouted(int(count), None if age is None else float(age))
