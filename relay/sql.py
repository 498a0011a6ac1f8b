"""The relay's statements: claim deliverable messages, settle a turn's outcomes.

Settling is one guarded statement for the whole turn: each row is matched by
its (id, fence) pair, the state `sending` and the owner, so a stale relay's
write touches nothing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_
from sqlalchemy.dialects import postgresql

from outbox.db.dialect import (
    UNPREPARED,
    bound_now,
    database_now,
    in_names,
    is_postgresql,
    not_in_names,
    upsert,
)
from outbox.db.sql import state_literal
from outbox.schema import messages, relays
from outbox.states import MessageState
from relay.records import ClaimedRow, Settlement

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
    messages.c.ordering_key,
)
"""The columns of a claimed row; `previous_attempts` follows them (see ClaimedRow)."""
# Claimed rows become ClaimedRow records by position, which is cheap per row: the
# RETURNING lists above and the record's fields stay in the same order (a test checks).


def _first_undelivered_of_its_key(m: Any) -> sa.ColumnElement[bool]:
    earlier = messages.alias("earlier")
    return sa.or_(
        m.c.ordering_key.is_(None),
        ~sa.exists().where(
            earlier.c.destination == m.c.destination,
            earlier.c.ordering_key == m.c.ordering_key,
            earlier.c.state.in_(
                (state_literal(MessageState.PENDING), state_literal(MessageState.SENDING))
            ),
            earlier.c.id < m.c.id,
        ),
    )


def _claim_values(now: Now, attempts: Any) -> dict[str, Any]:
    # Spent messages (their lease expired mid-send) are leased to resolve, not to send:
    # their attempt count stays as it is.
    budget = sa.bindparam("budget", type_=sa.Integer())
    return {
        "state": state_literal(MessageState.SENDING),
        "owner": sa.bindparam("claim_owner", type_=sa.String()),
        "lease_until": now + sa.bindparam("lease", type_=sa.Double()),
        "fence": messages.c.fence + 1,
        "attempts": sa.case((attempts < budget, attempts + 1), else_=attempts),
    }


def _routed_here(m: Any, dialect_name: str) -> Any:
    # Only destinations this relay delivers: another relay may deliver the rest, and a
    # message no relay knows waits, unrouted, instead of going dead.
    return and_(
        in_names(m.c.destination, "destinations", dialect_name),
        not_in_names(m.c.destination, "skip_destinations", dialect_name),
    )


def claim_session(dialect_name: str) -> str | None:
    """The session setting of the connection claims run on, or None (SQLite)."""
    if not is_postgresql(dialect_name):
        return None
    # Generic plans: a custom plan of the claim costs more to plan (0.4-0.7 ms here) than
    # to run for a live trickle, and auto mode keeps choosing custom ones. The claim, its
    # reap and its adoption are guarded as generic plans (tests/test_claim_plans.py).
    # Without JIT: behind a large backlog the generic plan's estimate passes
    # jit_above_cost, and JIT compiles anew at every execution (15-35 ms a claim here,
    # against 11 ms of work for 1,000 rows).
    return (
        "SELECT set_config('plan_cache_mode', 'force_generic_plan', false), "
        "set_config('jit', 'off', false)"
    )


@functools.cache
def _claim_statements(dialect_name: str) -> tuple[Any, Any]:
    """(pick, update) for a dialect, built once: SQLAlchemy then reuses their compiled SQL."""
    m = messages.alias("m")
    now = bound_now(dialect_name)
    limit = sa.bindparam("limit", type_=sa.Integer())
    due = (
        m.c.state == state_literal(MessageState.PENDING),
        m.c.available_at <= now,
        _first_undelivered_of_its_key(m),
    )
    if is_postgresql(dialect_name):
        # Each destination this relay delivers is picked on its own, along the
        # destination-first index, then the picks are merged in claim order: messages
        # for destinations it does not deliver (another relay's, or unrouted ones piling
        # up behind a typo) are never walked. Destinations with a full pipeline are left
        # out before their pick (a hung one must not stall the rest).
        names = (
            sa.func.unnest(sa.bindparam("destinations", type_=postgresql.ARRAY(sa.String())))
            .table_valued("name")
            .render_derived(name="d")
        )
        per_destination = (
            sa.select(m.c.id, m.c.attempts, m.c.available_at)
            .where(m.c.destination == names.c.name, *due)
            .order_by(m.c.available_at, m.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .lateral("per_destination")
        )
        skipped = sa.bindparam("skip_destinations", type_=postgresql.ARRAY(sa.String()))
        pick = (
            sa.select(per_destination.c.id, per_destination.c.attempts)
            .select_from(names.join(per_destination, sa.true()))
            .where(names.c.name != sa.all_(skipped))
            .order_by(per_destination.c.available_at, per_destination.c.id)
            .limit(limit)
        )
        # One statement. MATERIALIZED makes PostgreSQL run the pick once; as an IN
        # (subquery) a nested-loop plan may rescan it and take every row.
        picked = pick.cte("picked").prefix_with("MATERIALIZED")
        update = (
            sa.update(messages)
            .where(
                messages.c.id == picked.c.id,
                # The picks again as an array: the rows to update are then found by
                # primary-key probes. Joined on the CTE alone, a backlog of some tens of
                # thousands made a hash join look cheaper, built by scanning every
                # pending row at each claim (tests/test_claim_plans.py).
                messages.c.id == sa.any_(sa.func.array(sa.select(picked.c.id).scalar_subquery())),
                messages.c.state == state_literal(MessageState.PENDING),
            )
            .values(**_claim_values(now, picked.c.attempts))
            .returning(*CLAIMED, picked.c.attempts.label("previous_attempts"))
        )
        return None, update
    # SQLite, one writer and usually one relay: the claim-ordered index walk, filtered.
    pick = (
        sa.select(m.c.id, m.c.attempts)
        .where(*due, _routed_here(m, dialect_name))
        .order_by(m.c.available_at, m.c.id)
        .limit(limit)
    )
    update = (
        sa.update(messages)
        .where(messages.c.id.in_(sa.bindparam("ids", expanding=True)))
        .values(**_claim_values(now, messages.c.attempts))
        .returning(*CLAIMED)
    )
    return pick, update


def claim_messages(
    conn: sa.Connection,
    *,
    owner: str,
    now: float | None,
    lease: float,
    limit: int,
    budget: int,
    destinations: Sequence[str],
    skip_destinations: Sequence[str] = (),
) -> list[ClaimedRow]:
    """Lease up to `limit` due messages (oldest first, the first undelivered of each key).

    `now` is a manual clock's time, or None for the database's clock.
    """
    pick, update = _claim_statements(conn.dialect.name)
    params = {
        "now": now,
        "claim_owner": owner,
        "lease": lease,
        "limit": limit,
        "budget": budget,
        "destinations": list(destinations),
        "skip_destinations": list(skip_destinations),
    }
    if pick is None:
        # Fetched at once: iterating the result would fetch row by row.
        return [ClaimedRow._make(row) for row in conn.execute(update, params).all()]
    # SQLite: the transaction holds the write lock (BEGIN IMMEDIATE), so reading the
    # candidates first cannot race; its RETURNING cannot name the FROM table's columns.
    previous: dict[int, int] = {row[0]: row[1] for row in conn.execute(pick, params)}
    if not previous:
        return []
    updated = conn.execute(update, {**params, "ids": list(previous)})
    return [ClaimedRow._make((*row, previous[row.id])) for row in updated]


@functools.cache
def _adopt_statement(dialect_name: str) -> sa.Update:
    now = bound_now(dialect_name)
    return (
        sa.update(messages)
        .where(
            messages.c.state == state_literal(MessageState.SENDING),
            messages.c.owner == sa.bindparam("claim_owner", type_=sa.String()),
        )
        .values(
            lease_until=now + sa.bindparam("lease", type_=sa.Double()), fence=messages.c.fence + 1
        )
        .returning(*CLAIMED, (messages.c.attempts - 1).label("previous_attempts"))
    )


def adopt_messages(
    conn: sa.Connection, *, owner: str, now: float | None, lease: float
) -> list[ClaimedRow]:
    """Re-lease this owner's messages still marked sending, under a new fence.

    Run only after a claim whose COMMIT raised, with no turn of this relay in
    flight, so such rows were leased by that claim. Their counted attempt is the
    one about to be made. Rows are shaped as claim_messages returns them.
    """
    params = {"now": now, "claim_owner": owner, "lease": lease}
    rows = conn.execute(_adopt_statement(conn.dialect.name), params)
    return [ClaimedRow._make(row) for row in rows]


# Every outcome of a turn settles in ONE statement. A turn's outcomes are mostly alike,
# so the rows carry (id, fence, kind, delay) and each distinct kind (state, status,
# error, refund) travels once: numeric arrays are cheap to send, and the SQL text stays
# the same whatever the batch size. SQLite gets the rows as one JSON document.
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
# Driver SQL for psycopg: %(name)b sends an array in binary. In both statements `now` is
# a manual clock's time, or NULL for the database's (read in the statement itself).
# PostgreSQL answers with one row: the array of given ids it did not settle, usually
# empty (fenced rows are rare), instead of a row per settled message to read back.
SETTLE_POSTGRESQL = (
    """WITH v AS (
        SELECT r.id, r.fence, r.delay,
               (CAST(%(states)s AS varchar[]))[r.kind] AS state,
               (CAST(%(statuses)s AS integer[]))[r.kind] AS status,
               (CAST(%(errors)s AS text[]))[r.kind] AS error,
               (CAST(%(refunds)s AS integer[]))[r.kind] AS refund
        FROM unnest(
            CAST(%(ids)b AS bigint[]), CAST(%(fences)b AS bigint[]),
            CAST(%(kinds)b AS integer[]), CAST(%(delays)b AS float8[])
        ) AS r(id, fence, kind, delay)
    ), settled AS (
    UPDATE outbox_messages AS m SET"""
    + _SETTLE_SET.format(m="m", now=f"COALESCE(%(now)s::float8, {database_now('postgresql')})")
    + """FROM v
    WHERE"""
    + _SETTLE_WHERE.format(m="m", owner="%(owner)s")
    + """RETURNING m.id
    )
    SELECT ARRAY(SELECT id FROM v EXCEPT SELECT id FROM settled)"""
)
SETTLE_SQLITE = sa.text(
    "UPDATE outbox_messages SET"
    + _SETTLE_SET.format(m="outbox_messages", now=f"COALESCE(:now, {database_now('sqlite')})")
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


def settle(
    conn: sa.Connection, owner: str, rows: Sequence[Settlement], now: float | None
) -> set[int]:
    """Settle held messages in one statement; returns the ids it changed.

    `now` is a manual clock's time, or None for the database's clock.
    """
    if not rows:
        return set()
    if is_postgresql(conn.dialect.name):
        kinds: dict[tuple[str, int | None, str | None, int], int] = {}
        row_kinds = [
            kinds.setdefault((row.state, row.status, row.error, row.refund), len(kinds) + 1)
            for row in rows
        ]
        states, statuses, errors, refunds = (list(column) for column in zip(*kinds, strict=True))
        ids = [row.id for row in rows]
        params = {
            "ids": ids,
            "fences": [row.fence for row in rows],
            "kinds": row_kinds,
            "delays": [row.delay for row in rows],
            "states": states,
            "statuses": statuses,
            "errors": errors,
            "refunds": refunds,
            "owner": owner,
            "now": now,
        }
        # Planned per run: a generic plan may rescan the arrays once per row (see UNPREPARED).
        unsettled: list[int] = conn.exec_driver_sql(
            SETTLE_POSTGRESQL, params, execution_options={UNPREPARED: True}
        ).scalar_one()
        return set(ids).difference(unsettled)
    # Each Settlement is a JSON array in field order: see the json_extract paths above.
    result = conn.execute(SETTLE_SQLITE, {"rows": json.dumps(rows), "owner": owner, "now": now})
    return set(result.scalars().all())


def select_states(ids: Sequence[int]) -> sa.Select[Any]:
    """Re-read state, owner and fence of messages (to resolve an uncertain commit)."""
    return sa.select(messages.c.id, messages.c.state, messages.c.owner, messages.c.fence).where(
        messages.c.id.in_(list(ids))
    )


def destination_figures(now: Now) -> Any:
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


def live_destinations(now: Now) -> sa.Select[str]:
    """The destinations some relay announces and whose announcement has not lapsed."""
    return sa.select(relays.c.destination).where(relays.c.expires_at > now).distinct()


@functools.cache
def _announce_statement(dialect_name: str) -> Any:
    now = bound_now(dialect_name)
    return upsert(relays, dialect_name, ["owner", "destination"], ["expires_at"]).values(
        owner=sa.bindparam("owner", type_=sa.String()),
        destination=sa.bindparam("destination", type_=sa.String()),
        expires_at=now + sa.bindparam("lease", type_=sa.Double()),
    )


def announce(
    conn: sa.Connection,
    *,
    owner: str,
    destinations: Sequence[str],
    lease: float,
    now: float | None,
) -> None:
    """Say that `owner` delivers `destinations` for the next `lease` seconds (and no others).

    Lapsed announcements of any owner (relays that died) are deleted on the way.
    """
    conn.execute(
        relays.delete().where(relays.c.owner == owner, relays.c.destination.not_in(destinations))
    )
    conn.execute(
        relays.delete().where(relays.c.expires_at <= bound_now(conn.dialect.name)), {"now": now}
    )
    conn.execute(
        _announce_statement(conn.dialect.name),
        [{"owner": owner, "destination": d, "lease": lease, "now": now} for d in destinations],
    )


def withdraw(conn: sa.Connection, owner: str) -> None:
    """`owner` delivers nothing any more (a relay stopping)."""
    conn.execute(relays.delete().where(relays.c.owner == owner))
