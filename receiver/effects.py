"""Effects: the write a first receipt commits in its own transaction, exactly once.

An effect is called as `effect(session, body)` for each first receipt, on a
Session bound to the receipt's transaction; `session.info` carries the
reply_id and received_at. An effect with a `many(session, [(reply_id,
received_at, body)])` attribute gets a whole batch in one call instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.drivers import driver_for

#: Keys of ``session.info`` an effect can read.
REPLY_ID_KEY = "receiver.reply_id"
RECEIVED_AT_KEY = "receiver.received_at"

Effect = Callable[[Session, bytes], None]


def record_effect(session: Session, body: bytes) -> None:
    """The reference effect: one receiver_effects row per first receipt (joins the transaction)."""
    record_effects(session, [(session.info[REPLY_ID_KEY], session.info[RECEIVED_AT_KEY], body)])


def record_effects(session: Session, fresh: Sequence[tuple[str, float, bytes]]) -> None:
    """The reference effect for a batch: one statement for every first receipt."""
    conn = session.connection()
    driver_for(conn).insert_effects(conn, fresh)


record_effect.many = record_effects  # type: ignore[attr-defined]


def run_effects(
    conn: sa.Connection, effect: Effect, fresh: Sequence[tuple[str, float, bytes]]
) -> None:
    """Run `effect` for each first receipt in one Session on the receipts' transaction."""
    if effect is record_effect:
        # The reference effect needs no Session: building one per request costs more
        # than the insert itself.
        driver_for(conn).insert_effects(conn, fresh)
        return
    # rollback_only: inside a SAVEPOINT (an isolated item) the default would open a
    # savepoint of the Session's own, which close() rolls back with the effect's writes.
    session = Session(bind=conn, join_transaction_mode="rollback_only")
    try:
        many = getattr(effect, "many", None)
        if many is not None:
            many(session, fresh)
        else:
            for reply_id, received_at, body in fresh:
                session.info[REPLY_ID_KEY] = reply_id
                session.info[RECEIVED_AT_KEY] = received_at
                effect(session, body)
        session.flush()
    finally:
        # The session joined our transaction: closing it neither commits nor rolls back.
        session.close()
