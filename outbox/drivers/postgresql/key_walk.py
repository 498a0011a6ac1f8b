"""PostgreSQL's walk of each destination's ordering keys, one index probe per key."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_

from outbox.db.sql import state_literal
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import messages
from outbox.states import MessageState

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
# key cursor, outbox.drivers.records.KeyWalk) and goes on from the first key when it
# passes the last, so every key is reached within a bounded number of claims, whatever
# its name: keys that sort first and keep receiving messages cannot hold back one that
# sorts last.


ONE = sa.literal_column("1", sa.Integer())
"""LIMIT 1 written out: a generic plan guesses a bound LIMIT to keep a tenth of the rows."""


def ordering_entries(o: Any, destination: Any) -> list[Any]:
    """ix_outbox_messages_ordering's entries for one destination: its key and predicate."""
    return [
        o.c.destination == destination,
        # The index's predicate, written out so that a generic plan can use it.
        o.c.ordering_key.is_not(None),
        o.c.state.in_((state_literal(MessageState.PENDING), state_literal(MessageState.SENDING))),
    ]


def key_walk(pieces: DriverPieces, names: Any, skipped: Any) -> Any:
    """The recursive CTE of each destination's keys, as one row per key reached.

    Columns: destination, ordering_key, id (the key's first undelivered message; NULL on
    each destination's seed row), ok (that message is claimable), visited, found, lap
    (1 after passing the last key), start (the cursor it began after).
    """
    now = pieces.bound_now()
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
            .where(*ordering_entries(o, w.c.destination), o.c.ordering_key > after, *more)
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
