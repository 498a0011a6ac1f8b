"""The receiver's statements: insert receipts (and the reference effect), read, purge;
the consumer's dead letters.

On PostgreSQL the inserts are driver SQL with array parameters sent in binary
(`%(name)b`), or strings the statement splits: one short, cacheable statement
whatever the batch size, where the text format would escape every element on
the client. SQLite takes the same rows through SQLAlchemy Core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from outbox.clock import Clock
from outbox.db.dialect import (
    clock_value,
    database_now,
    insert_ignoring_conflicts,
    is_postgresql,
    now_expression,
)
from receiver.schema import dead_letters, effects, receipts

INSERT_EFFECTS_POSTGRESQL = (
    "INSERT INTO receiver_effects (reply_id, created_at, body) "
    "SELECT * FROM unnest("
    "CAST(%(ids)b AS varchar[]), CAST(%(times)b AS float8[]), CAST(%(bodies)b AS bytea[]))"
)


def _insert_receipts_postgresql(with_reference_effect: bool) -> str:
    """Insert receipts unless stored (and, if asked, their reference effects) in one statement.

    Its one row is the receipts' received_at (one value for the whole statement: a
    manual clock's %(now)s, else the statement's time) and the array of the given
    reply_ids that were stored already, usually empty. Sending back that instead of
    a row per new receipt spares the database and the receiver a row each.

    Reply_ids and hex hashes hold no space: they go joined by spaces, one string
    each, which costs the client a join where an array parameter costs it a
    Python call per element.
    """
    effect = (
        "effect AS (INSERT INTO receiver_effects (reply_id, created_at, body) "
        "SELECT reply_id, received_at, body FROM new), "
        if with_reference_effect
        else ""
    )
    return (
        f"WITH clock AS (SELECT COALESCE(%(now)s::float8, {database_now('postgresql')}) AS at), "
        "given AS (SELECT * FROM unnest("
        "string_to_array(%(ids)s, ' ')::varchar[], string_to_array(%(hashes)s, ' ')::varchar[], "
        "CAST(%(bodies)b AS bytea[])) AS t(reply_id, content_hash, body)), "
        "new AS (INSERT INTO receiver_receipts (reply_id, content_hash, body, received_at) "
        "SELECT given.reply_id, given.content_hash, given.body, clock.at FROM given, clock "
        "ON CONFLICT (reply_id) DO NOTHING RETURNING reply_id, received_at, body), "
        f"{effect}"
        "held AS (SELECT reply_id FROM given EXCEPT ALL SELECT reply_id FROM new) "
        "SELECT clock.at, ARRAY(SELECT reply_id FROM held) FROM clock"
    )


INSERT_RECEIPTS_POSTGRESQL = _insert_receipts_postgresql(with_reference_effect=False)
# The reference effect rides on the same statement: the rows the receipt insert returns
# (first receipts only) are its effect rows. One round trip and one parse fewer per
# request than running it after the insert.
INSERT_RECEIPTS_AND_EFFECTS_POSTGRESQL = _insert_receipts_postgresql(with_reference_effect=True)


def insert_effects(conn: sa.Connection, fresh: Sequence[tuple[str, float, bytes]]) -> None:
    """The reference effect's rows, (reply_id, received_at, body) each, in one statement."""
    if is_postgresql(conn.dialect.name):
        # Arrays keep it one short statement: an executemany costs a round trip per row.
        conn.exec_driver_sql(
            INSERT_EFFECTS_POSTGRESQL,
            {
                "ids": [r for r, _, _ in fresh],
                "times": [at for _, at, _ in fresh],
                "bodies": [body for _, _, body in fresh],
            },
        )
        return
    conn.execute(
        effects.insert(),
        [{"reply_id": r, "created_at": at, "body": body} for r, at, body in fresh],
    )


def insert_receipts(
    conn: sa.Connection,
    reply_ids: Sequence[str],
    hashes: Sequence[str],
    bodies: Sequence[bytes],
    clock: Clock | None,
    *,
    with_reference_effect: bool = False,
) -> dict[str, float]:
    """Insert receipts (distinct, checked reply_ids) unless stored; the new ones' received_at.

    `with_reference_effect` (PostgreSQL only) writes the reference effect of
    each new receipt in the same statement.
    """
    if is_postgresql(conn.dialect.name):
        statement = (
            INSERT_RECEIPTS_AND_EFFECTS_POSTGRESQL
            if with_reference_effect
            else INSERT_RECEIPTS_POSTGRESQL
        )
        parameters = {
            "now": clock_value(clock),
            "ids": " ".join(reply_ids),
            "hashes": " ".join(hashes),
            "bodies": list(bodies),
        }
        received_at, held = conn.exec_driver_sql(statement, parameters).one()
        inserted = dict.fromkeys(reply_ids, float(received_at))
        for reply_id in held:
            del inserted[reply_id]
        return inserted
    result = conn.execute(
        insert_ignoring_conflicts(receipts, conn.dialect.name)
        .values(received_at=now_expression(clock, conn.dialect.name))
        .returning(receipts.c.reply_id, receipts.c.received_at),
        [
            {"reply_id": reply_id, "content_hash": digest, "body": body}
            for reply_id, digest, body in zip(reply_ids, hashes, bodies, strict=True)
        ],
    )
    return {row.reply_id: float(row.received_at) for row in result.all()}


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


def insert_dead_letter(conn: sa.Connection, row: dict[str, Any], clock: Clock | None) -> None:
    """Keep a message given up on; a reply_id already dead (another consumer's copy) stays."""
    dialect = conn.dialect.name
    conn.execute(
        insert_ignoring_conflicts(dead_letters, dialect).values(
            dead_at=now_expression(clock, dialect), **row
        )
    )


def select_dead_among(reply_ids: Sequence[str]) -> sa.Select[Any]:
    """Which of `reply_ids` are dead letters."""
    return sa.select(dead_letters.c.reply_id).where(dead_letters.c.reply_id.in_(list(reply_ids)))


LISTED = (
    dead_letters.c.reply_id,
    dead_letters.c.reason,
    dead_letters.c.failures,
    dead_letters.c.deliveries,
    dead_letters.c.broker,
    dead_letters.c.dead_at,
)


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
