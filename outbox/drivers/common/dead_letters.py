"""The broker consumers' dead letters in portable Core."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.receiver_tables import dead_letters

LISTED = (
    dead_letters.c.reply_id,
    dead_letters.c.reason,
    dead_letters.c.failures,
    dead_letters.c.deliveries,
    dead_letters.c.broker,
    dead_letters.c.dead_at,
)
"""What a list of dead letters shows of each."""


def select_dead_among(reply_ids: Sequence[str]) -> sa.Select[Any]:
    """Which of `reply_ids` are dead letters."""
    return sa.select(dead_letters.c.reply_id).where(dead_letters.c.reply_id.in_(list(reply_ids)))


def select_dead_letters(limit: int) -> sa.Select[Any]:
    """The oldest `limit` dead letters, without their bodies."""
    return sa.select(*LISTED).order_by(dead_letters.c.dead_at, dead_letters.c.reply_id).limit(limit)


def select_dead_letter(reply_id: str) -> sa.Select[Any]:
    """One dead letter, whole."""
    return sa.select(dead_letters).where(dead_letters.c.reply_id == reply_id)


def delete_dead_letter(reply_id: str) -> sa.Delete:
    """Forget one dead letter."""
    return dead_letters.delete().where(dead_letters.c.reply_id == reply_id)


def delete_dead_before(cutoff: sa.ColumnElement[float]) -> sa.Delete:
    """Forget the dead letters given up on before `cutoff`."""
    return dead_letters.delete().where(dead_letters.c.dead_at < cutoff)


class DeadLetterStatements(DriverPieces):
    """Dead letters: kept once per reply_id, listed oldest first, forgotten."""

    def insert_dead_letter(self, conn: Connection, row: dict[str, Any], now: Now) -> None:
        """Keep a message given up on; a reply_id already dead (another copy's) stays."""
        conn.execute(
            self.insert_ignoring_conflicts(dead_letters).values(dead_at=self.now_sql(now), **row)
        )

    def dead_among(self, conn: Connection, reply_ids: Sequence[str]) -> set[str]:
        """Which of `reply_ids` are dead letters."""
        return {row.reply_id for row in conn.execute(select_dead_among(reply_ids))}

    def dead_letters(self, conn: Connection, limit: int) -> list[dict[str, Any]]:
        """The oldest `limit` dead letters, without their bodies."""
        return [dict(row) for row in conn.execute(select_dead_letters(limit)).mappings()]

    def dead_letter(self, conn: Connection, reply_id: str) -> RowMapping | None:
        """One dead letter, whole, or None."""
        return conn.execute(select_dead_letter(reply_id)).mappings().first()

    def delete_dead_letter(self, conn: Connection, reply_id: str) -> int:
        """Forget one dead letter; how many were deleted (0 or 1)."""
        return int(conn.execute(delete_dead_letter(reply_id)).rowcount)

    def delete_dead_letters_before(self, conn: Connection, now: Now, older_than: float) -> int:
        """Forget the dead letters given up on over `older_than` seconds ago; how many."""
        cutoff = self.now_sql(now) - older_than
        return int(conn.execute(delete_dead_before(cutoff)).rowcount)
