"""PostgreSQL's receipt and reference-effect inserts: driver SQL with array parameters.

Array parameters sent in binary (`%(name)b`), or strings the statement splits: one
short, cacheable statement whatever the batch size, where the text format would
escape every element on the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.engine import Connection

from outbox.drivers.base import Now

STATEMENT_NOW = "extract(epoch from statement_timestamp())::float8"
"""The database's time in epoch seconds, as of the statement's start."""

INSERT_EFFECTS = (
    "INSERT INTO receiver_effects (reply_id, created_at, body) "
    "SELECT * FROM unnest("
    "CAST(%(ids)b AS varchar[]), CAST(%(times)b AS float8[]), CAST(%(bodies)b AS bytea[]))"
)


def _insert_receipts(with_reference_effect: bool) -> str:
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
        f"WITH clock AS (SELECT COALESCE(%(now)s::float8, {STATEMENT_NOW}) AS at), "
        "given AS (SELECT * FROM unnest("
        "string_to_array(%(ids)s, ' ')::varchar[], string_to_array(%(hashes)s, ' ')::varchar[], "
        "CAST(%(bodies)b AS bytea[])) AS t(reply_id, content_hash, body)), "
        "new AS (INSERT INTO receiver_receipts (reply_id, content_hash, body, received_at) "
        "SELECT given.reply_id, given.content_hash, given.body, clock.at FROM given, clock "
        "ON CONFLICT (reply_id) DO NOTHING RETURNING reply_id, received_at, body), "
        f"{effect}"
        "held AS (SELECT reply_id FROM given EXCEPT ALL SELECT reply_id FROM new) "
        # All stored (the usual batch): no need to hash both lists to find none held.
        "SELECT clock.at, CASE WHEN (SELECT count(*) FROM new) = (SELECT count(*) FROM given) "
        "THEN '{}'::varchar[] ELSE ARRAY(SELECT reply_id FROM held) END FROM clock"
    )


INSERT_RECEIPTS = _insert_receipts(with_reference_effect=False)
# The reference effect rides on the same statement: the rows the receipt insert returns
# (first receipts only) are its effect rows. One round trip and one parse fewer per
# request than running it after the insert.
INSERT_RECEIPTS_AND_EFFECTS = _insert_receipts(with_reference_effect=True)


def insert_receipts(
    conn: Connection,
    reply_ids: Sequence[str],
    hashes: Sequence[str],
    bodies: Sequence[bytes],
    now: Now,
    with_reference_effect: bool,
) -> dict[str, float]:
    """Insert receipts unless stored, in one statement; the new ones' received_at."""
    statement = INSERT_RECEIPTS_AND_EFFECTS if with_reference_effect else INSERT_RECEIPTS
    parameters = {
        "now": now,
        "ids": " ".join(reply_ids),
        "hashes": " ".join(hashes),
        "bodies": list(bodies),
    }
    received_at, held = conn.exec_driver_sql(statement, parameters).one()
    inserted = dict.fromkeys(reply_ids, float(received_at))
    for reply_id in held:
        del inserted[reply_id]
    return inserted


def insert_effects(conn: Connection, fresh: Sequence[tuple[str, float, bytes]]) -> None:
    """The reference effect's rows in one statement."""
    # Arrays keep it one short statement: an executemany costs a round trip per row.
    conn.exec_driver_sql(
        INSERT_EFFECTS,
        {
            "ids": [r for r, _, _ in fresh],
            "times": [at for _, at, _ in fresh],
            "bodies": [body for _, _, body in fresh],
        },
    )
