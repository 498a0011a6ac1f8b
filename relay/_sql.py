"""The relay's statements: claim deliverable messages, settle a turn's outcomes.

Settling is one guarded statement for the whole turn: each row is matched by
its (id, fence) pair, the state `sending` and the owner, so a stale relay's
write touches nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from outbox._dialect import UNPREPARED
from outbox.clock import database_now
from outbox.schema import messages

Now = sa.ColumnElement[float]
CLAIMED = (
    messages.c.id,
    messages.c.reply_id,
    messages.c.destination,
    messages.c.body,
    messages.c.content_hash,
    messages.c.headers,
    messages.c.attempts,
    messages.c.fence,
    messages.c.available_at,
)


def _first_undelivered_of_its_key(m: Any) -> sa.ColumnElement[bool]:
    earlier = messages.alias("earlier")
    return sa.or_(
        m.c.ordering_key.is_(None),
        ~sa.exists().where(
            earlier.c.destination == m.c.destination,
            earlier.c.ordering_key == m.c.ordering_key,
            earlier.c.state.in_(("pending", "sending")),
            earlier.c.id < m.c.id,
        ),
    )


def _deliverable(m: Any, now: Now) -> list[sa.ColumnElement[bool]]:
    return [m.c.state == "pending", m.c.available_at <= now, _first_undelivered_of_its_key(m)]


def _claim_values(owner: str, now: Now, lease: float, attempts: Any, budget: int) -> dict[str, Any]:
    # Spent messages (their lease expired mid-send) are leased to resolve, not to send:
    # their attempt count stays as it is.
    return {
        "state": "sending",
        "owner": owner,
        "lease_until": now + lease,
        "fence": messages.c.fence + 1,
        "attempts": sa.case((attempts < budget, attempts + 1), else_=attempts),
    }


def claim_messages(
    conn: sa.Connection, *, owner: str, now: Now, lease: float, limit: int, budget: int
) -> list[Any]:
    """Lease up to `limit` due messages (oldest first, the first undelivered of each key).

    Each returned row carries `previous_attempts`: when it is already `budget`,
    the message was reclaimed after a lease expired mid-send and may only be
    resolved (receipt lookup, else dead), never sent again.
    """
    m = messages.alias("m")
    pick = (
        sa.select(m.c.id, m.c.attempts)
        .where(*_deliverable(m, now))
        .order_by(m.c.available_at, m.c.id)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        # One statement. MATERIALIZED makes PostgreSQL run the LIMIT ... SKIP LOCKED pick
        # once; as an IN (subquery) a nested-loop plan may rescan it and take every row.
        picked = pick.with_for_update(skip_locked=True).cte("picked").prefix_with("MATERIALIZED")
        statement = (
            sa.update(messages)
            .where(messages.c.id == picked.c.id, messages.c.state == "pending")
            .values(**_claim_values(owner, now, lease, picked.c.attempts, budget))
            .returning(*CLAIMED, picked.c.attempts.label("previous_attempts"))
        )
        return list(conn.execute(statement).mappings().all())
    # SQLite: the transaction holds the write lock (BEGIN IMMEDIATE), so reading the
    # candidates first cannot race; its RETURNING cannot name the FROM table's columns.
    previous: dict[int, int] = {row.id: row.attempts for row in conn.execute(pick)}
    if not previous:
        return []
    statement = (
        sa.update(messages)
        .where(messages.c.id.in_(list(previous)))
        .values(**_claim_values(owner, now, lease, messages.c.attempts, budget))
        .returning(*CLAIMED)
    )
    return [
        {**row, "previous_attempts": previous[row["id"]]}
        for row in conn.execute(statement).mappings()
    ]


def adopt_messages(owner: str, now: Now, lease: float) -> sa.Update:
    """Re-lease this owner's messages still marked sending, under a new fence.

    Run only after a claim whose COMMIT raised: a relay runs one turn at a time,
    so such rows were leased by that claim. Their counted attempt is the one
    about to be made.
    """
    return (
        sa.update(messages)
        .where(messages.c.state == "sending", messages.c.owner == owner)
        .values(lease_until=now + lease, fence=messages.c.fence + 1)
        .returning(*CLAIMED, (messages.c.attempts - 1).label("previous_attempts"))
    )


# Every outcome of a turn settles in ONE statement: the rows' (id, fence, state, status,
# error, delay) travel as arrays (PostgreSQL) or one JSON document (SQLite), so the SQL
# text stays short and cached whatever the batch size. The WHERE clause is the fence.
_SETTLE_SET = """
    state = v.state,
    lease_until = NULL,
    attempts = {m}.attempts - v.refund,
    last_status = v.status,
    last_error = v.error,
    sent_at = CASE WHEN v.state = 'sent' THEN {now} ELSE {m}.sent_at END,
    available_at = CASE WHEN v.state = 'pending' THEN {now} + v.delay ELSE {m}.available_at END
"""
_SETTLE_WHERE = """
    {m}.id = v.id AND {m}.fence = v.fence AND {m}.state = 'sending' AND {m}.owner = {owner}
"""
# Driver SQL for psycopg: %(name)b sends an array in binary, where the text format would
# escape every element with a regular expression on the client. %(now)s is a manual
# clock's time, or NULL for the database's (read in the statement: no extra round trip).
SETTLE_POSTGRESQL = (
    "UPDATE outbox_messages AS m SET"
    + _SETTLE_SET.format(m="m", now=f"COALESCE(%(now)s::float8, {database_now('postgresql')})")
    + """FROM unnest(
        CAST(%(ids)b AS bigint[]), CAST(%(fences)b AS bigint[]), CAST(%(states)b AS varchar[]),
        CAST(%(statuses)b AS integer[]), CAST(%(errors)b AS text[]), CAST(%(delays)b AS float8[]),
        CAST(%(refunds)b AS integer[])
    ) AS v(id, fence, state, status, error, delay, refund)
    WHERE"""
    + _SETTLE_WHERE.format(m="m", owner="%(owner)s")
    + "RETURNING m.id"
)
SETTLE_SQLITE = sa.text(
    "UPDATE outbox_messages SET"
    + _SETTLE_SET.format(m="outbox_messages", now=":now")
    + """FROM (
        SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS fence,
               json_extract(value, '$[2]') AS state, json_extract(value, '$[3]') AS status,
               json_extract(value, '$[4]') AS error, json_extract(value, '$[5]') AS delay,
               json_extract(value, '$[6]') AS refund
        FROM json_each(:rows)
    ) AS v
    WHERE"""
    + _SETTLE_WHERE.format(m="outbox_messages", owner=":owner")
    + "RETURNING outbox_messages.id"
)

Settlement = tuple[int, int, str, int | None, str | None, float, int]
"""(id, fence, new state, HTTP status, error, delay before the next attempt, attempts to
give back: 1 when the claim counted an attempt that was never made)."""


def settle(
    conn: sa.Connection, owner: str, rows: Sequence[Settlement], now: float | None
) -> set[int]:
    """Settle held messages in one statement; returns the ids it changed.

    `now` is a manual clock's time, or None for the database's clock.
    """
    if conn.dialect.name == "postgresql":
        names = ("ids", "fences", "states", "statuses", "errors", "delays", "refunds")
        params: dict[str, Any] = {
            name: [row[index] for row in rows] for index, name in enumerate(names)
        }
        params.update(owner=owner, now=now)
        # Planned per run: a generic plan may rescan the arrays once per row (see UNPREPARED).
        result = conn.exec_driver_sql(
            SETTLE_POSTGRESQL, params, execution_options={UNPREPARED: True}
        )
    else:
        if now is None:
            now = float(conn.execute(sa.select(database_now(conn.dialect.name))).scalar_one())
        result = conn.execute(SETTLE_SQLITE, {"rows": json.dumps(rows), "owner": owner, "now": now})
    return set(result.scalars().all())


def select_states(ids: Sequence[int]) -> sa.Select[Any]:
    """Re-read state, owner and fence of messages (to resolve an uncertain commit)."""
    return sa.select(messages.c.id, messages.c.state, messages.c.owner, messages.c.fence).where(
        messages.c.id.in_(list(ids))
    )


def backlog(now: Now) -> Any:
    """How many messages are undelivered, and the age of the oldest (None when none)."""
    undelivered = messages.c.state.in_(("pending", "sending"))
    return sa.select(sa.func.count(), now - sa.func.min(messages.c.created_at)).where(undelivered)
