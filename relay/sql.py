"""The relay's statements: claim deliverable messages, settle a turn's outcomes.

Settling is one guarded statement for the whole turn: each row is matched by
its (id, fence) pair, the state `sending` and the owner, so a stale relay's
write touches nothing.
"""

from __future__ import annotations

import dataclasses
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
from outbox.db.sql import state_literal, state_unindexed
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
    messages.c.lease_until,
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
    # Without bitmap or sequential scans: every statement of this connection walks an
    # index in order and stops at its limit, or at a key's first entry, where either scan
    # reads every matching row first and sorts them. A generic plan that guessed one
    # matching row (its statistics taken while nothing was keyed, say) took one for each
    # probe of a key, and would keep it behind a backlog (tests/test_claim_plans.py).
    return (
        "SELECT set_config('plan_cache_mode', 'force_generic_plan', false), "
        "set_config('jit', 'off', false), set_config('enable_bitmapscan', 'off', false), "
        "set_config('enable_seqscan', 'off', false)"
    )


KEY_CHAIN = 1000
"""At most this many messages of one ordering key after its first in one claim."""
# A claim that takes the first undelivered message of a key also takes the key's next
# messages, in id order, while each is pending, due and has attempts left: a key moves
# many messages per claim instead of one. Due matters only for a message retried
# before (a backoff or a Retry-After the destination asked for); a never-attempted one,
# or one held back behind its key, is due at once. A spent message (its lease expired
# mid-send with no attempts left) is only resolved, after the turn's sends, so it ends
# a chain, and a spent first message starts none. The chain stops at the first message
# that does not qualify: a later one would overtake it.
#
# The successors are claimed by a second statement, only after the first messages' claim
# has committed, and only when it leased keyed ones: a claim that took no keyed message
# is one statement. By then each first message is `sending` under
# this relay, so no other claim can take its successors (a message is claimable alone
# only when no lower id of its key is pending or sending), and the second statement
# needs no SKIP LOCKED. Claims are the only writers of pending rows (the reaper and
# adoption change sending ones, operators' decisions dead ones), so a successor seen
# pending is still pending when the UPDATE locks it: the chain has no gap. Should the
# relay stop between the two statements, the successors simply stay pending.


def _qualifies(s: Any, now: Now) -> sa.ColumnElement[bool]:
    """A successor that may join its key's chain (see KEY_CHAIN)."""
    return and_(
        s.c.state == state_literal(MessageState.PENDING),
        s.c.available_at <= now,
        s.c.attempts < sa.bindparam("budget", type_=sa.Integer()),
    )


def _successors(s: Any, destination: Any, key: Any, after: Any) -> list[Any]:
    """The walk of ix_outbox_messages_ordering from a key's first message."""
    return [
        s.c.destination == destination,
        s.c.ordering_key == key,
        s.c.id > after,
        # The index's predicate, written out so that a generic plan can use it.
        s.c.ordering_key.is_not(None),
        s.c.state.in_((state_literal(MessageState.PENDING), state_literal(MessageState.SENDING))),
    ]


KEY_WALK = 2
"""A PostgreSQL claim visits at most this many keys of a destination per message it may take."""
# PostgreSQL picks in two parts, merged in claim order (available_at, then id). Unkeyed
# messages walk ix_outbox_messages_unkeyed, which holds no keyed message. Keys are
# walked along ix_outbox_messages_ordering, one probe per key (a loose index scan): the
# first entry after the previous key is the next key's lowest pending or sending id,
# which is its first undelivered message, claimable when it is pending and due. A spent
# one (attempts at the budget) is claimed too, to be resolved, as before. So a claim
# never walks the messages held back behind their key, which behind a backlog of long
# keys were nearly all of them.
#
# One walk stops after `limit` claimable first messages, or after KEY_WALK x `limit`
# keys: with thousands of keys a claim reads only so many (each probe is ~10 us). It
# starts after the key where the relay's previous walk of that destination stopped (its
# key cursor, see claim_messages) and goes on from the first key when it passes the last,
# so every key is reached within a bounded number of claims, whatever its name: keys
# that sort first and keep receiving messages cannot hold back one that sorts last.


@dataclasses.dataclass
class KeyWalk:
    """Where a relay's claims walk a destination's keys (PostgreSQL), from claim to claim.

    `cursors`: per destination, the last key the previous walk reached; the next walk
    goes on after it. `heads`: how many first messages a walk may take, None for the
    claim's limit. A claim whose keys' chains alone filled the room its first messages
    left halves it: the keys are long, and fewer of them a claim leave the others to the
    next claim, of this relay's pipeline or of another relay, so that several turns
    deliver keyed messages at once instead of one turn holding every key. Any other claim
    doubles it again (up to the limit).
    """

    cursors: dict[str, str] = dataclasses.field(default_factory=dict)
    heads: int | None = None

    def after_claim(self, limit: int, heads: Sequence[ClaimedRow], chained: int) -> None:
        """Adjust `heads` to a claim of `limit` that took `heads` and `chained` successors."""
        if not any(h.ordering_key is not None for h in heads):
            return
        taking = min(self.heads or limit, limit)
        room = limit - len(heads)
        if room > 0 and chained >= room:
            self.heads = max(1, taking // 2)
        else:
            # Room left, or none left to chain into (other messages filled the claim): the
            # keys were not what crowded it, so the next walk may take more of them. Never
            # left low while unkeyed messages fill the claims.
            self.heads = min(limit, taking * 2)


ONE = sa.literal_column("1", sa.Integer())
"""LIMIT 1 written out: a generic plan guesses a bound LIMIT to keep a tenth of the rows."""


def _ordering_entries(o: Any, destination: Any) -> list[Any]:
    """ix_outbox_messages_ordering's entries for one destination: its key and predicate."""
    return [
        o.c.destination == destination,
        # The index's predicate, written out so that a generic plan can use it.
        o.c.ordering_key.is_not(None),
        o.c.state.in_((state_literal(MessageState.PENDING), state_literal(MessageState.SENDING))),
    ]


def _key_walk(dialect_name: str, names: Any, skipped: Any) -> Any:
    """The recursive CTE of each destination's keys, as one row per key reached.

    Columns: destination, ordering_key, id (the key's first undelivered message; NULL on
    each destination's seed row), ok (that message is claimable), visited, found, lap
    (1 after passing the last key), start (the cursor it began after).
    """
    now = bound_now(dialect_name)
    pending = state_literal(MessageState.PENDING)
    seed = sa.select(
        names.c.name.label("destination"),
        sa.func.coalesce(names.c.after, "").label("ordering_key"),
        sa.cast(sa.null(), sa.BigInteger()).label("id"),
        sa.false().label("ok"),
        sa.literal(0, sa.Integer()).label("visited"),
        sa.literal(0, sa.Integer()).label("found"),
        sa.literal(0, sa.Integer()).label("lap"),
        names.c.after.label("start"),
    ).where(names.c.name != sa.all_(skipped))
    walk = seed.cte("walk", recursive=True)
    w = walk.alias("w")

    def probe(o: Any, after: Any, lap: Any, *more: Any) -> Any:
        # The first entry after `after`: the next key and its lowest pending or sending id.
        return (
            sa.select(
                o.c.ordering_key,
                o.c.id,
                and_(o.c.state == pending, o.c.available_at <= now).label("ok"),
                lap.label("lap"),
            )
            .where(*_ordering_entries(o, w.c.destination), o.c.ordering_key > after, *more)
            .order_by(o.c.ordering_key, o.c.id)
            .limit(ONE)
        )

    following = probe(messages.alias("o"), w.c.ordering_key, w.c.lap)
    # Past the last key, once: from the first key again, up to the one it started after.
    first = probe(
        messages.alias("o_first"),
        sa.literal("", sa.String()),
        sa.literal(1, sa.Integer()),
        w.c.lap == 0,
        w.c.start.is_not(None),
    )
    step = sa.union_all(following, first).limit(ONE).lateral("step")
    return walk.union_all(
        sa.select(
            w.c.destination,
            step.c.ordering_key,
            step.c.id,
            step.c.ok,
            w.c.visited + 1,
            w.c.found + sa.case((step.c.ok, 1), else_=0),
            step.c.lap,
            w.c.start,
        )
        .select_from(w.join(step, sa.true()))
        .where(
            w.c.visited < sa.bindparam("key_cap", type_=sa.Integer()),
            w.c.found < sa.bindparam("key_heads", type_=sa.Integer()),
            sa.or_(step.c.lap == 0, step.c.ordering_key <= w.c.start),
        )
    )


@functools.cache
def _claim_statements(dialect_name: str) -> tuple[Any, Any]:
    """(pick, update) for a dialect, built once: SQLAlchemy then reuses their compiled SQL.

    On PostgreSQL the update is a SELECT: the claimed rows, then one row per destination
    whose keys were walked, with no id, its destination and the last key it reached.
    """
    m = messages.alias("m")
    now = bound_now(dialect_name)
    limit = sa.bindparam("limit", type_=sa.Integer())
    if is_postgresql(dialect_name):
        # Each destination this relay delivers is picked on its own, along
        # destination-first indexes, then the picks are merged in claim order: messages
        # for destinations it does not deliver (another relay's, or unrouted ones piling
        # up behind a typo) are never walked. Destinations with a full pipeline are left
        # out before their pick (a hung one must not stall the rest).
        names = (
            sa.func.unnest(
                sa.bindparam("destinations", type_=postgresql.ARRAY(sa.String())),
                sa.bindparam("key_cursors", type_=postgresql.ARRAY(sa.String())),
            )
            .table_valued("name", "after")
            .render_derived(name="d")
        )
        skipped = sa.bindparam("skip_destinations", type_=postgresql.ARRAY(sa.String()))
        unkeyed = (
            sa.select(m.c.id, m.c.attempts, m.c.available_at)
            .where(
                m.c.destination == names.c.name,
                # ix_outbox_messages_unkeyed's predicate, and no other index's (see
                # outbox.schema.UNKEYED_PENDING), written out for a generic plan.
                sa.case((m.c.ordering_key.is_(None), m.c.state))
                == state_literal(MessageState.PENDING),
                m.c.available_at <= now,
            )
            .order_by(m.c.available_at, m.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .lateral("unkeyed")
        )
        walk = _key_walk(dialect_name, names, skipped)
        k = messages.alias("k")
        heads = sa.select(walk.c.id).where(walk.c.ok).scalar_subquery()
        keyed = (
            sa.select(k.c.id, k.c.attempts, k.c.available_at)
            .where(
                # The walk's claimable first messages, found by primary-key probes. No
                # test of their state here: it would let a generic plan made while little
                # is pending walk ix_outbox_messages_deliverable, every pending message,
                # instead. One another claim took meanwhile is locked all the same, and
                # left out by the update, which tests the state of what it updates.
                k.c.id == sa.any_(sa.func.array(heads)),
                k.c.available_at <= now,
            )
            .order_by(k.c.available_at, k.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .subquery("keyed")
        )
        candidates = sa.union_all(
            sa.select(unkeyed.c.id, unkeyed.c.attempts, unkeyed.c.available_at)
            .select_from(names.join(unkeyed, sa.true()))
            .where(names.c.name != sa.all_(skipped)),
            sa.select(keyed.c.id, keyed.c.attempts, keyed.c.available_at),
        ).subquery("candidates")
        pick = (
            sa.select(candidates.c.id, candidates.c.attempts)
            .order_by(candidates.c.available_at, candidates.c.id)
            .limit(limit)
        )
        # One statement. MATERIALIZED makes PostgreSQL run the pick once; as an IN
        # (subquery) a nested-loop plan may rescan it and take every row.
        picked = pick.cte("picked").prefix_with("MATERIALIZED")
        budget = sa.bindparam("budget", type_=sa.Integer())
        spent = sa.select(picked.c.id).where(picked.c.attempts >= budget).scalar_subquery()
        claimed = (
            sa.update(messages)
            .where(
                # The picks as an array, found by primary-key probes, and no join: joined
                # on the CTE, a backlog of some tens of thousands made a hash join look
                # cheaper, built by scanning every pending row at each claim, and a pick
                # the planner guessed at one row a nested loop reading every pick once
                # per pick (tests/test_claim_plans.py). The picks are locked: each row's
                # attempts are still those picked.
                messages.c.id == sa.any_(sa.func.array(sa.select(picked.c.id).scalar_subquery())),
                state_unindexed(messages.c.state, MessageState.PENDING),
            )
            .values(**_claim_values(now, messages.c.attempts))
            .returning(
                *CLAIMED,
                # A spent message keeps its count (see _claim_values); spent ones are rare,
                # so the array they make is usually empty.
                sa.case(
                    (messages.c.id == sa.any_(sa.func.array(spent)), messages.c.attempts),
                    else_=messages.c.attempts - 1,
                ).label("previous_attempts"),
            )
            .cte("claimed")
        )
        reached = (
            sa.select(walk.c.destination, walk.c.ordering_key)
            .where(walk.c.id.is_not(None))
            .ext(postgresql.distinct_on(walk.c.destination))
            .order_by(walk.c.destination, walk.c.visited.desc())
            .subquery("reached")
        )
        cursors = sa.select(
            *(
                reached.c[column.name]
                if column.name in ("destination", "ordering_key")
                else sa.cast(sa.null(), column.type)
                for column in CLAIMED
            ),
            sa.cast(sa.null(), sa.Integer()),
        )
        return None, sa.union_all(sa.select(claimed), cursors)
    # SQLite, one writer and usually one relay: the claim-ordered index walk, filtered.
    pick = (
        sa.select(m.c.id, m.c.attempts)
        .where(
            m.c.state == state_literal(MessageState.PENDING),
            m.c.available_at <= now,
            _first_undelivered_of_its_key(m),
            _routed_here(m, dialect_name),
        )
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


@functools.cache
def _chain_statement(dialect_name: str) -> Any:
    """The successors' claim: PostgreSQL's UPDATE, or SQLite's select of one key's chain."""
    s = messages.alias("s")
    now = bound_now(dialect_name)
    share = sa.bindparam("share", type_=sa.Integer())
    if not is_postgresql(dialect_name):
        # SQLite has no LATERAL: one walk per key, under the claim's write lock.
        return (
            sa.select(s.c.id, s.c.attempts, _qualifies(s, now))
            .where(
                *_successors(
                    s,
                    sa.bindparam("destination", type_=sa.String()),
                    sa.bindparam("key", type_=sa.String()),
                    sa.bindparam("head", type_=sa.BigInteger()),
                )
            )
            .order_by(s.c.id)
            .limit(share)
        )
    heads = (
        sa.func.unnest(
            sa.bindparam("head_ids", type_=postgresql.ARRAY(sa.BigInteger())),
            sa.bindparam("head_destinations", type_=postgresql.ARRAY(sa.String())),
            sa.bindparam("head_keys", type_=postgresql.ARRAY(sa.String())),
        )
        .table_valued("id", "destination", "ordering_key", with_ordinality="position")
        .render_derived(name="h")
    )
    successor = (
        sa.select(s.c.id, s.c.attempts, _qualifies(s, now).label("ok"))
        .where(*_successors(s, heads.c.destination, heads.c.ordering_key, heads.c.id))
        .order_by(s.c.id)
        .limit(share)
        .lateral("successor")
    )
    by_key = heads.c.position
    chain = (
        sa.select(
            successor.c.id,
            successor.c.attempts,
            heads.c.position,
            sa.func.row_number().over(partition_by=by_key, order_by=successor.c.id).label("rank"),
            sa.func.bool_and(successor.c.ok)
            .over(partition_by=by_key, order_by=successor.c.id)
            .label("unbroken"),
        )
        .select_from(heads.join(successor, sa.true()))
        .subquery("chain")
    )
    # Rank by rank: every key's second message, then every third, within the room left.
    chosen = (
        sa.select(chain.c.id, chain.c.attempts)
        .where(chain.c.unbroken)
        .order_by(chain.c.rank, chain.c.position)
        .limit(sa.bindparam("room", type_=sa.Integer()))
        .cte("chosen")
        .prefix_with("MATERIALIZED")
    )
    return (
        sa.update(messages)
        .where(
            # Primary-key probes, as in the first messages' claim, and no join: joined on
            # the chosen rows, which a generic plan guesses at one, the update walked
            # ix_outbox_messages_routable, every pending message, at each claim (a tenth
            # of a second behind a backlog of 20,000; tests/test_claim_plans.py).
            messages.c.id == sa.any_(sa.func.array(sa.select(chosen.c.id).scalar_subquery())),
            state_unindexed(messages.c.state, MessageState.PENDING),
        )
        # A chained message has attempts left (it qualified), so its count goes up by one.
        .values(**_claim_values(now, messages.c.attempts))
        .returning(*CLAIMED, (messages.c.attempts - 1).label("previous_attempts"))
    )


def _claim_chains(
    conn: sa.Connection, heads: Sequence[ClaimedRow], params: dict[str, Any]
) -> list[ClaimedRow]:
    """Lease the next messages of the keys whose first messages were just leased.

    Each key reads at most its share of the room the first messages left (KEY_CHAIN at
    most), and the chains fill that room rank by rank, so many keys share a claim and
    each key's part is a prefix of its chain.
    """
    keyed = sorted(
        (h for h in heads if h.ordering_key is not None and h.previous_attempts < params["budget"]),
        key=lambda h: h.id,
    )
    room = params["limit"] - len(heads)
    if not keyed or room <= 0:
        return []
    share = min(KEY_CHAIN, -(-room // len(keyed)))
    statement = _chain_statement(conn.dialect.name)
    if is_postgresql(conn.dialect.name):
        chained = {
            **params,
            "head_ids": [h.id for h in keyed],
            "head_destinations": [h.destination for h in keyed],
            "head_keys": [h.ordering_key for h in keyed],
            "share": share,
            "room": room,
        }
        return [ClaimedRow._make(row) for row in conn.execute(statement, chained).all()]
    chains: list[list[tuple[int, int]]] = []
    for head in keyed:
        found = conn.execute(
            statement,
            {
                **params,
                "destination": head.destination,
                "key": head.ordering_key,
                "head": head.id,
                "share": share,
            },
        )
        chain: list[tuple[int, int]] = []
        for successor_id, attempts, ok in found:
            if not ok:
                break
            chain.append((successor_id, attempts))
        chains.append(chain)
    previous: dict[int, int] = {}
    for rank in range(max(len(c) for c in chains)):
        for chain in chains:
            if rank < len(chain) and len(previous) < room:
                previous[chain[rank][0]] = chain[rank][1]
    if not previous:
        return []
    update = _claim_statements(conn.dialect.name)[1]
    updated = conn.execute(update, {**params, "ids": list(previous)})
    return [ClaimedRow._make((*row, previous[row.id])) for row in updated]


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
    keys: KeyWalk | None = None,
) -> list[ClaimedRow]:
    """Lease up to `limit` due messages: the oldest first, the first undelivered of each
    key, and after each such first its key's next messages (see KEY_CHAIN).

    `now` is a manual clock's time, or None for the database's clock. `keys` is where
    this relay's claims walk ordering keys (PostgreSQL, see KEY_WALK): this claim's walk
    goes on from it, and moves it.
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
        walk = KeyWalk() if keys is None else keys
        walked = {
            **params,
            "key_cursors": [walk.cursors.get(d) for d in destinations],
            "key_cap": KEY_WALK * limit,
            "key_heads": min(walk.heads or limit, limit),
        }
        heads = []
        # Fetched at once: iterating the result would fetch row by row.
        for row in conn.execute(update, walked).all():
            if row[0] is None:
                walk.cursors[row.destination] = row.ordering_key
            else:
                heads.append(ClaimedRow._make(row))
        chained = _claim_chains(conn, heads, params)
        walk.after_claim(limit, heads, len(chained))
        return heads + chained
    # SQLite: the transaction holds the write lock (BEGIN IMMEDIATE), so reading the
    # candidates first cannot race; its RETURNING cannot name the FROM table's columns.
    previous: dict[int, int] = {row[0]: row[1] for row in conn.execute(pick, params)}
    if not previous:
        return []
    updated = conn.execute(update, {**params, "ids": list(previous)})
    heads = [ClaimedRow._make((*row, previous[row.id])) for row in updated]
    return heads + _claim_chains(conn, heads, params)


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
    # The leases the turn holds (a claim gives all its rows one lease_until): without them
    # the lease index would be walked whole, every relay's messages in flight, per settle.
    + """ AND m.lease_until = ANY(CAST(%(leases)b AS float8[]))
    RETURNING m.id
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
        params = settle_parameters(owner, rows, now)
        # Planned per run: a generic plan may rescan the arrays once per row (see UNPREPARED).
        unsettled: list[int] = conn.exec_driver_sql(
            SETTLE_POSTGRESQL, params, execution_options={UNPREPARED: True}
        ).scalar_one()
        return set(params["ids"]).difference(unsettled)
    # Each Settlement is a JSON array in field order: see the json_extract paths above.
    result = conn.execute(SETTLE_SQLITE, {"rows": json.dumps(rows), "owner": owner, "now": now})
    return set(result.scalars().all())


def settle_parameters(owner: str, rows: Sequence[Settlement], now: float | None) -> dict[str, Any]:
    """SETTLE_POSTGRESQL's parameters for `rows`, which name the leases they were claimed under."""
    leases = {row.lease_until for row in rows}
    if None in leases:
        # NULL matches no lease: the row would stay sending, be taken for lost and sent again.
        raise ValueError("a settlement without the lease it was claimed under")
    kinds: dict[tuple[str, int | None, str | None, int], int] = {}
    row_kinds = [
        kinds.setdefault((row.state, row.status, row.error, row.refund), len(kinds) + 1)
        for row in rows
    ]
    states, statuses, errors, refunds = (list(column) for column in zip(*kinds, strict=True))
    return {
        "ids": [row.id for row in rows],
        "fences": [row.fence for row in rows],
        "kinds": row_kinds,
        "delays": [row.delay for row in rows],
        "states": states,
        "statuses": statuses,
        "errors": errors,
        "refunds": refunds,
        "leases": list(leases),
        "owner": owner,
        "now": now,
    }


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
