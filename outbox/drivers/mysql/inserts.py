"""Inserts whose callers need the new row or whether it was new, and the guarded resolve:
each its statements in the caller's transaction.

MySQL has no RETURNING: a new row is read back by its id. MariaDB 10.5 and later return
it from the INSERT itself (SQLAlchemy's `insert_returning` says which server it is),
which saves publish() a round trip."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult, RowMapping

from outbox.drivers.base import Now
from outbox.drivers.common.messages import message_values
from outbox.drivers.common.operations import unique_reply_ids
from outbox.drivers.common.receipts import ReceiptStatements
from outbox.drivers.common.task_decisions import insert_task_decision, select_task_decision
from outbox.drivers.mysql.once import insert_once
from outbox.receiver_tables import receipts
from outbox.schema import inbox, messages, requeues


def select_message_by_id(message_id: int) -> sa.Select[Any]:
    """One message row by id (a new row read back)."""
    return sa.select(messages).where(messages.c.id == message_id)


def select_audits_newest_first(reply_ids: Sequence[str]) -> sa.Select[Any]:
    """Every audit row of these reply_ids, newest first (ix_outbox_requeues_reply_id)."""
    return (
        sa.select(requeues)
        .where(requeues.c.reply_id.in_(list(reply_ids)))
        .order_by(requeues.c.id.desc())
    )


def new_id(result: CursorResult[Any]) -> int:
    """The auto-increment id an INSERT of one row was given."""
    key = result.inserted_primary_key
    if key is None or key[0] is None:
        raise RuntimeError("the INSERT reported no new id")
    return int(key[0])


def select_oldest(cutoff: sa.ColumnElement[float], batch: int) -> sa.Select[Any]:
    """Up to `batch` receipts received before `cutoff`, oldest first."""
    return (
        sa.select(receipts.c.reply_id)
        .where(receipts.c.received_at < cutoff)
        .order_by(receipts.c.received_at)
        .limit(batch)
    )


class MySQLInserts(ReceiptStatements):
    """publish()'s insert, the inbox row, receipts, the audit row and resolve."""

    @cached_property
    def insert_one_message(self) -> Any:
        """INSERT one message as pending, due at :now or the database's clock; built once."""
        return message_values(messages.insert(), self.bound_now())

    @cached_property
    def insert_one_message_returning(self) -> Any:
        """insert_one_message returning the new row (MariaDB); built once."""
        return self.insert_one_message.returning(*messages.c)

    def insert_message(self, conn: Connection, row: dict[str, Any], now: Now) -> RowMapping | None:
        """Insert one message as pending and due now unless its reply_id exists: the new
        row (returned, or read back by its id), or None when it existed."""
        params = {**row, "now": now}
        if conn.dialect.insert_returning:
            returned = insert_once(conn, self.insert_one_message_returning, params)
            return None if returned is None else returned.mappings().one()
        result = insert_once(conn, self.insert_one_message, params)
        if result is None:
            return None
        return conn.execute(select_message_by_id(new_id(result))).mappings().one()

    def insert_inbox(
        self,
        conn: Connection,
        principal: str,
        message_id: str,
        content: str,
        content_hash: str,
        task_id: str,
        now: float,
    ) -> bool:
        """Insert an inbox row unless (principal, message_id) is stored; whether it was."""
        statement = inbox.insert().values(
            principal=principal,
            message_id=message_id,
            content_hash=content_hash,
            content=content,
            task_id=task_id,
            received_at=now,
        )
        return insert_once(conn, statement) is not None

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
        received_at: those not held, in one INSERT, or one by one when another writer
        stored one of them meanwhile."""
        if with_reference_effect:
            raise ValueError(f"the {self.name} driver writes reference effects apart")
        held = {receipt.reply_id for receipt in self.held_receipts(conn, reply_ids)}
        at = float(conn.execute(sa.select(self.now_sql(now))).scalar_one())
        rows: list[dict[str, Any]] = [
            {"reply_id": reply_id, "content_hash": digest, "body": body, "received_at": at}
            for reply_id, digest, body in zip(reply_ids, hashes, bodies, strict=True)
            if reply_id not in held
        ]
        if not rows:
            return {}
        if insert_once(conn, receipts.insert(), rows) is not None:
            return {row["reply_id"]: at for row in rows}
        return {
            row["reply_id"]: at
            for row in rows
            if insert_once(conn, receipts.insert(), row) is not None
        }

    def insert_decision_audits(
        self, conn: Connection, rows: Sequence[dict[str, Any]], now: Now
    ) -> list[dict[str, Any]]:
        """The audit rows of decisions about dead messages (a reply_id once each), requested
        `now`: one multi-row INSERT, then one read of them back (MySQL has no INSERT ...
        RETURNING), each the newest audit of its reply_id: the caller holds the messages'
        rows locked, so no other decision about them can write one meanwhile."""
        if not rows:
            return []
        reply_ids = unique_reply_ids(rows)
        at = float(conn.execute(sa.select(self.now_sql(now))).scalar_one())
        conn.execute(requeues.insert(), [{**values, "requested_at": at} for values in rows])
        newest: dict[str, dict[str, Any]] = {}
        for row in conn.execute(select_audits_newest_first(reply_ids)).mappings():
            newest.setdefault(row["reply_id"], dict(row))
        return [newest[reply_id] for reply_id in reply_ids]

    def insert_task_decision(
        self, conn: Connection, values: dict[str, Any], now: Now
    ) -> dict[str, Any]:
        """One audit row of a decision about a task, requested `now`; read back by its id."""
        decision_id = new_id(conn.execute(insert_task_decision(self), {**values, "now": now}))
        return dict(conn.execute(select_task_decision(decision_id)).mappings().one())

    def purge_receipts(self, conn: Connection, now: Now, older_than: float, batch: int) -> int:
        """Delete up to `batch` receipts received over `older_than` seconds ago, oldest
        first; how many. Chosen first, then deleted by key: MariaDB takes no LIMIT in an
        IN subquery."""
        chosen = list(conn.execute(select_oldest(self.now_sql(now) - older_than, batch)).scalars())
        if not chosen:
            return 0
        return int(conn.execute(receipts.delete().where(receipts.c.reply_id.in_(chosen))).rowcount)
