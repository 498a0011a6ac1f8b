"""SQLite's settle: one UPDATE FROM the turn's rows, sent as one JSON document."""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.failed_attempts import record_settled_failures
from outbox.drivers.common.settle import SETTLE_SET, SETTLE_WHERE
from outbox.drivers.records import FailedAttempt, Settlement
from outbox.drivers.sqlite.clock import DATABASE_NOW

SETTLE_SQLITE = sa.text(
    "UPDATE outbox_messages SET"
    + SETTLE_SET.format(m="outbox_messages", now=f"COALESCE(:now, {DATABASE_NOW})")
    + """FROM (
        SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS fence,
               json_extract(value, '$[2]') AS state, json_extract(value, '$[3]') AS status,
               json_extract(value, '$[4]') AS error, json_extract(value, '$[5]') AS delay,
               json_extract(value, '$[6]') AS refund
        FROM json_each(:rows)
    ) AS v
    WHERE"""
    + SETTLE_WHERE.format(m="outbox_messages", owner=":owner")
    + "RETURNING outbox_messages.id"
)


def settle(
    conn: Connection,
    owner: str,
    rows: Sequence[Settlement],
    now: Now,
    failures: Sequence[FailedAttempt] = (),
) -> set[int]:
    """Settle held messages in one statement; returns the ids it changed."""
    if not rows:
        return set()
    # Each Settlement is a JSON array in field order: see the json_extract paths above.
    result = conn.execute(SETTLE_SQLITE, {"rows": json.dumps(rows), "owner": owner, "now": now})
    settled = set(result.scalars().all())
    record_settled_failures(conn, failures, settled, now, DATABASE_NOW)
    return settled
