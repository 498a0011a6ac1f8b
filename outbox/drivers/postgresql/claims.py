"""PostgreSQL's claim: each destination picked on its own along destination-first indexes,
keys walked one probe each (outbox.drivers.postgresql.key_walk), chains in one UPDATE.

Every statement here runs on the claims' own connection, set up by CLAIM_SESSION.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from outbox.db.sql import state_literal, state_unindexed
from outbox.drivers.base import Now
from outbox.drivers.common.claims import (
    CLAIMED,
    ClaimStatements,
    chain_room,
    claim_parameters,
    claim_values,
    qualifies,
    successors,
)
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.execution import BINARY_ROWS
from outbox.drivers.postgresql.key_walk import key_walk
from outbox.drivers.records import KEY_WALK, ClaimedRow, KeyWalk
from outbox.schema import messages
from outbox.states import MessageState

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
CLAIM_SESSION = (
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', false), "
    "set_config('jit', 'off', false), set_config('enable_bitmapscan', 'off', false), "
    "set_config('enable_seqscan', 'off', false)"
)
"""The session settings of the connection claims run on."""


@functools.cache
def claim_statement(pieces: DriverPieces) -> Any:
    """The claim, built once: SQLAlchemy then reuses its compiled SQL.

    A SELECT: the claimed rows, then one row per destination whose keys were walked,
    with no id, its destination and the last key it reached.
    """
    m = messages.alias("m")
    now = pieces.bound_now()
    limit = sa.bindparam("limit", type_=sa.Integer())
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
            sa.case((m.c.ordering_key.is_(None), m.c.state)) == state_literal(MessageState.PENDING),
            m.c.available_at <= now,
        )
        .order_by(m.c.available_at, m.c.id)
        # Its own bound: a claim's later rounds walk keys alone (see KEY_ROUNDS).
        .limit(sa.bindparam("unkeyed_limit", type_=sa.Integer()))
        .with_for_update(skip_locked=True)
        .lateral("unkeyed")
    )
    walk = key_walk(pieces, names, skipped)
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
        .values(**claim_values(now, messages.c.attempts))
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
    return sa.union_all(sa.select(claimed), cursors)


@functools.cache
def chain_statement(pieces: DriverPieces) -> Any:
    """The successors' claim: one UPDATE of every key's chain, built once."""
    s = messages.alias("s")
    now = pieces.bound_now()
    share = sa.bindparam("share", type_=sa.Integer())
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
        sa.select(s.c.id, s.c.attempts, qualifies(s, now).label("ok"))
        .where(*successors(s, heads.c.destination, heads.c.ordering_key, heads.c.id))
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
        .values(**claim_values(now, messages.c.attempts))
        .returning(*CLAIMED, (messages.c.attempts - 1).label("previous_attempts"))
    )


CLAIM_OPTIONS = {BINARY_ROWS: True}
"""The claims' execution options: their rows, bodies and all, come in binary."""

KEY_ROUNDS = 3
"""A PostgreSQL claim takes keys' first messages and their chains in at most this many rounds."""
# A claim's walk takes at most `heads` first messages (KeyWalk), so that long keys spread
# over several turns in flight. Behind keys of some hundred messages each, the few keys
# a walk then takes can leave a claim half full (three keys of 170 messages in a claim of
# 1,000): half-full turns, and more of them, each a POST and a settle. So while a round
# took its bound of keys, every one's whole run, and left room, another round walks on
# from the cursor for as many more keys as those runs say fill the room, and chains them.
# Every round is the same two statements: a key's messages still leave in one claim, in
# order, and its successors are still claimed only after its first message's claim.


def key_round_heads(heads: Sequence[ClaimedRow], chained: int, taking: int, room: int) -> int:
    """How many first messages the claim's next round walks for: 0 for no next round.

    One only when the round took all `taking` keys it walked for and their chains ended
    before their share of the room (the walk stopped at its bound, and more keys may be
    waiting), and room is left; as many as the round's runs, on average, fill it.
    """
    keyed = sum(1 for h in heads if h.ordering_key is not None)
    if room <= 0 or keyed == 0 or keyed < taking:
        return 0
    run = 1 + chained / keyed  # a key's first message and its chain, on average
    return max(1, min(room, round(room / run)))


class PostgreSQLClaims(ClaimStatements):
    """The claim on PostgreSQL: one statement for the first messages, one for their chains."""

    def claim_session(self) -> str | None:
        """The session settings of the claims' connection (CLAIM_SESSION)."""
        return CLAIM_SESSION

    def claim_messages(
        self,
        conn: Connection,
        *,
        owner: str,
        now: Now,
        lease: float,
        limit: int,
        budget: int,
        destinations: Sequence[str],
        skip_destinations: Sequence[str] = (),
        keys: KeyWalk | None = None,
    ) -> list[ClaimedRow]:
        """Lease up to `limit` due messages: the oldest first, the first undelivered of each
        key, and after each such first its key's next messages (see KEY_CHAIN), in up to
        KEY_ROUNDS rounds while the keys' runs leave room (see key_round_heads).

        `keys` is where this relay's claims walk ordering keys (see KEY_WALK): this
        claim's walk goes on from it, and moves it.
        """
        params = claim_parameters(owner, now, lease, limit, budget, destinations, skip_destinations)
        walk = KeyWalk() if keys is None else keys
        taking = min(walk.heads or limit, limit)
        claimed: list[ClaimedRow] = []
        for round_ in range(KEY_ROUNDS):
            room = limit - len(claimed)
            # A round that left room took every due unkeyed message it could lock: later
            # rounds do not walk their index again (behind a drained backlog whose
            # entries no vacuum has removed yet, a walk of some tens of milliseconds).
            unkeyed = room if round_ == 0 else 0
            heads, chained = self._claim_round(
                conn, walk, {**params, "limit": room, "unkeyed_limit": unkeyed}, taking
            )
            claimed += heads
            claimed += chained
            if round_ == 0:
                walk.after_claim(limit, heads, len(chained))
            taking = key_round_heads(heads, len(chained), taking, limit - len(claimed))
            if not taking:
                break
        return claimed

    def _claim_round(
        self, conn: Connection, walk: KeyWalk, params: dict[str, Any], taking: int
    ) -> tuple[list[ClaimedRow], list[ClaimedRow]]:
        """One round of a claim: up to `taking` keys' first messages, then their chains."""
        walked = {
            **params,
            "key_cursors": [walk.cursors.get(d) for d in params["destinations"]],
            "key_cap": KEY_WALK * params["limit"],
            "key_heads": taking,
        }
        heads = []
        # Fetched at once: iterating the result would fetch row by row.
        rows = conn.execute(claim_statement(self), walked, execution_options=CLAIM_OPTIONS).all()
        for row in rows:
            if row[0] is None:
                walk.cursors[row.destination] = row.ordering_key
            else:
                heads.append(ClaimedRow._make(row))
        return heads, self.claim_chains(conn, heads, params)

    def claim_chains(
        self, conn: Connection, heads: Sequence[ClaimedRow], params: dict[str, Any]
    ) -> list[ClaimedRow]:
        """Lease the next messages of the keys whose first messages were just leased."""
        keyed, room, share = chain_room(heads, params["limit"], params["budget"])
        if not keyed:
            return []
        chained = {
            **params,
            "head_ids": [h.id for h in keyed],
            "head_destinations": [h.destination for h in keyed],
            "head_keys": [h.ordering_key for h in keyed],
            "share": share,
            "room": room,
        }
        statement = chain_statement(self)
        rows = conn.execute(statement, chained, execution_options=CLAIM_OPTIONS).all()
        return [ClaimedRow._make(row) for row in rows]
