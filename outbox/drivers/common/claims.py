"""The relay's claim of deliverable messages: the portable pieces, and SQLite's claim.

A claim leases up to `limit` due messages: the oldest first, the first undelivered of
each key, and after each such first its key's next messages (see KEY_CHAIN).
PostgreSQL claims its own way (outbox.drivers.postgresql.claims) from the pieces here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_
from sqlalchemy.engine import Connection

from outbox.db.sql import state_literal
from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import ClaimedRow, KeyWalk
from outbox.schema import messages
from outbox.states import MessageState

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


def first_undelivered_of_its_key(m: Any) -> sa.ColumnElement[bool]:
    """No lower id of the message's key (if it has one) is pending or sending."""
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


def claim_values(now: sa.ColumnElement[float], attempts: Any) -> dict[str, Any]:
    """The SET of a claim: sending, under this owner and a new fence, an attempt counted."""
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


def routed_here(pieces: DriverPieces, m: Any) -> Any:
    """The message's destination is one this relay delivers and not a busy one."""
    # Only destinations this relay delivers: another relay may deliver the rest, and a
    # message no relay knows waits, unrouted, instead of going dead.
    return and_(
        pieces.in_names(m.c.destination, "destinations"),
        pieces.not_in_names(m.c.destination, "skip_destinations"),
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


def qualifies(s: Any, now: sa.ColumnElement[float]) -> sa.ColumnElement[bool]:
    """A successor that may join its key's chain (see KEY_CHAIN)."""
    return and_(
        s.c.state == state_literal(MessageState.PENDING),
        s.c.available_at <= now,
        s.c.attempts < sa.bindparam("budget", type_=sa.Integer()),
    )


def successors(s: Any, destination: Any, key: Any, after: Any) -> list[Any]:
    """The walk of ix_outbox_messages_ordering from a key's first message."""
    return [
        s.c.destination == destination,
        s.c.ordering_key == key,
        s.c.id > after,
        # The index's predicate, written out so that a generic plan can use it.
        s.c.ordering_key.is_not(None),
        s.c.state.in_((state_literal(MessageState.PENDING), state_literal(MessageState.SENDING))),
    ]


def chain_room(
    heads: Sequence[ClaimedRow], limit: int, budget: int
) -> tuple[list[ClaimedRow], int, int]:
    """The keyed first messages that start chains (id order), the room left, each key's share.

    Each key reads at most its share of the room the first messages left (KEY_CHAIN at
    most), and the chains fill that room rank by rank, so many keys share a claim and
    each key's part is a prefix of its chain.
    """
    keyed = sorted(
        (h for h in heads if h.ordering_key is not None and h.previous_attempts < budget),
        key=lambda h: h.id,
    )
    room = limit - len(heads)
    if not keyed or room <= 0:
        return [], room, 0
    return keyed, room, min(KEY_CHAIN, -(-room // len(keyed)))


@functools.cache
def claim_statements(pieces: DriverPieces) -> tuple[Any, Any]:
    """SQLite's (pick, update), built once: SQLAlchemy then reuses their compiled SQL."""
    # SQLite, one writer and usually one relay: the claim-ordered index walk, filtered.
    m = messages.alias("m")
    now = pieces.bound_now()
    pick = (
        sa.select(m.c.id, m.c.attempts)
        .where(
            m.c.state == state_literal(MessageState.PENDING),
            m.c.available_at <= now,
            first_undelivered_of_its_key(m),
            routed_here(pieces, m),
        )
        .order_by(m.c.available_at, m.c.id)
        .limit(sa.bindparam("limit", type_=sa.Integer()))
    )
    update = (
        sa.update(messages)
        .where(messages.c.id.in_(sa.bindparam("ids", expanding=True)))
        .values(**claim_values(now, messages.c.attempts))
        .returning(*CLAIMED)
    )
    return pick, update


@functools.cache
def chain_statement(pieces: DriverPieces) -> Any:
    """SQLite's select of one key's chain (it has no LATERAL: one walk per key)."""
    s = messages.alias("s")
    return (
        sa.select(s.c.id, s.c.attempts, qualifies(s, pieces.bound_now()))
        .where(
            *successors(
                s,
                sa.bindparam("destination", type_=sa.String()),
                sa.bindparam("key", type_=sa.String()),
                sa.bindparam("head", type_=sa.BigInteger()),
            )
        )
        .order_by(s.c.id)
        .limit(sa.bindparam("share", type_=sa.Integer()))
    )


def claim_parameters(
    owner: str,
    now: Now,
    lease: float,
    limit: int,
    budget: int,
    destinations: Sequence[str],
    skip_destinations: Sequence[str],
) -> dict[str, Any]:
    """The parameters every claim statement shares."""
    return {
        "now": now,
        "claim_owner": owner,
        "lease": lease,
        "limit": limit,
        "budget": budget,
        "destinations": list(destinations),
        "skip_destinations": list(skip_destinations),
    }


class ClaimStatements(DriverPieces):
    """The claim as a backend with one writer runs it: pick, then update, under its lock."""

    def claim_session(self) -> str | None:
        """No session settings: SQLite plans each statement as it is."""
        return None

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
        """Lease up to `limit` due messages, the first undelivered of each key, and their
        keys' next messages; `keys` is not used (one writer walks no key cursor)."""
        params = claim_parameters(owner, now, lease, limit, budget, destinations, skip_destinations)
        pick, update = claim_statements(self)
        # The transaction holds the write lock (BEGIN IMMEDIATE), so reading the
        # candidates first cannot race; its RETURNING cannot name the FROM table's columns.
        previous: dict[int, int] = {row[0]: row[1] for row in conn.execute(pick, params)}
        if not previous:
            return []
        updated = conn.execute(update, {**params, "ids": list(previous)})
        heads = [ClaimedRow._make((*row, previous[row.id])) for row in updated]
        return heads + self.claim_chains(conn, heads, params)

    def claim_chains(
        self, conn: Connection, heads: Sequence[ClaimedRow], params: dict[str, Any]
    ) -> list[ClaimedRow]:
        """Lease the next messages of the keys whose first messages were just leased."""
        keyed, room, share = chain_room(heads, params["limit"], params["budget"])
        if not keyed:
            return []
        statement = chain_statement(self)
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
        update = claim_statements(self)[1]
        updated = conn.execute(update, {**params, "ids": list(previous)})
        return [ClaimedRow._make((*row, previous[row.id])) for row in updated]
