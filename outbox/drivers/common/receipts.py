"""The receiver's receipts and reference effects in portable Core."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import HeldReceipt, Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.receiver_tables import effects, receipts


def select_held(reply_ids: Sequence[str]) -> sa.Select[Any]:
    """The content hash and received_at of stored receipts."""
    return sa.select(receipts.c.reply_id, receipts.c.content_hash, receipts.c.received_at).where(
        receipts.c.reply_id.in_(list(reply_ids))
    )


def select_receipt(reply_id: str) -> sa.Select[Any]:
    """One receipt's content hash and received_at."""
    return sa.select(receipts.c.content_hash, receipts.c.received_at).where(
        receipts.c.reply_id == reply_id
    )


def select_body(reply_id: str) -> sa.Select[Any]:
    """One receipt's stored body."""
    return sa.select(receipts.c.body).where(receipts.c.reply_id == reply_id)


def delete_oldest(cutoff: sa.ColumnElement[float], batch: int) -> sa.Delete:
    """Delete up to `batch` receipts received before `cutoff`, oldest first."""
    oldest = (
        sa.select(receipts.c.reply_id)
        .where(receipts.c.received_at < cutoff)
        .order_by(receipts.c.received_at)
        .limit(batch)
    )
    return receipts.delete().where(receipts.c.reply_id.in_(oldest))


class ReceiptStatements(DriverPieces):
    """Receipts: an insert that ignores conflicts and returns the new rows, and reads."""

    fuses_reference_effect = False

    def insert_receipts(
        self,
        conn: Connection,
        reply_ids: Sequence[str],
        hashes: Sequence[str],
        bodies: Sequence[bytes],
        now: Now,
        *,
        with_reference_effect: bool = False,
    ) -> dict[str, float]:
        """Insert receipts (distinct, checked reply_ids) unless stored; the new ones'
        received_at."""
        if with_reference_effect:
            raise ValueError(f"the {self.name} driver writes reference effects apart")
        result = conn.execute(
            self.insert_ignoring_conflicts(receipts)
            .values(received_at=self.now_sql(now))
            .returning(receipts.c.reply_id, receipts.c.received_at),
            [
                {"reply_id": reply_id, "content_hash": digest, "body": body}
                for reply_id, digest, body in zip(reply_ids, hashes, bodies, strict=True)
            ],
        )
        return {row.reply_id: float(row.received_at) for row in result.all()}

    def insert_effects(self, conn: Connection, fresh: Sequence[tuple[str, float, bytes]]) -> None:
        """The reference effect's rows, (reply_id, received_at, body) each."""
        conn.execute(
            effects.insert(),
            [{"reply_id": r, "created_at": at, "body": body} for r, at, body in fresh],
        )

    def held_receipts(self, conn: Connection, reply_ids: Sequence[str]) -> list[HeldReceipt]:
        """The stored receipts among `reply_ids`."""
        return [
            HeldReceipt(row.reply_id, row.content_hash, float(row.received_at))
            for row in conn.execute(select_held(reply_ids))
        ]

    def receipt(self, conn: Connection, reply_id: str) -> HeldReceipt | None:
        """One stored receipt, or None."""
        row = conn.execute(select_receipt(reply_id)).first()
        if row is None:
            return None
        return HeldReceipt(reply_id, row.content_hash, float(row.received_at))

    def receipt_body(self, conn: Connection, reply_id: str) -> bytes | None:
        """One receipt's stored body, or None."""
        row = conn.execute(select_body(reply_id)).first()
        return None if row is None else bytes(row.body)

    def purge_receipts(self, conn: Connection, now: Now, older_than: float, batch: int) -> int:
        """Delete up to `batch` receipts received over `older_than` seconds ago, oldest
        first; how many."""
        cutoff = self.now_sql(now) - older_than
        return int(conn.execute(delete_oldest(cutoff, batch)).rowcount)
