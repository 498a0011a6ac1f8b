"""The relay's claim on MySQL: locking picks with SKIP LOCKED, an UPDATE by id, a read.

Each destination the relay delivers is picked on its own, so that messages of
destinations it does not deliver (another relay's, or unrouted ones piling up behind a
typo) are never walked, in two parts merged in claim order:

- its unkeyed pending messages, walked in claim order along
  ix_outbox_messages_state_routable (state, destination, ordering_key, available_at,
  id), whose `ordering_key IS NULL` range holds no keyed message, and locked;
- its keys with a pending message, read in key order along the same index from the
  relay's key cursor on (at most KEY_WALK per message the claim may take), each with its
  lowest pending id (one probe of ix_outbox_messages_state_ordering), locked by primary
  key and kept where no lower id of its key is pending or sending and it is due. The
  read passes index entries alone, and a long key's only where the walk crosses it; no
  message held back behind its key's first is tested one by one, which behind one long
  key would be nearly all of them.

The picks are merged in claim order and the first `limit` leased; the rest stay pending
(their locks end with the claim's transaction). Each key's next messages are then walked
along ix_outbox_messages_state_ordering, locked (no other claim can take them: their
key's first message is this relay's), and leased the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import limit_parameter, state_literal
from outbox.drivers.base import Now
from outbox.drivers.common.claims import (
    CLAIMED,
    chain_room,
    claim_parameters,
    claim_values,
    qualifies,
    successors,
)
from outbox.drivers.common.failed_attempts import record_expired
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.mysql.key_walk import head_lock, key_walk
from outbox.drivers.mysql.picks import by_keys, picked, write_picked
from outbox.drivers.records import KEY_WALK, ClaimedRow, KeyWalk
from outbox.schema import messages
from outbox.states import MessageState


@functools.cache
def unkeyed_pick(pieces: DriverPieces) -> sa.Select[Any]:
    """Up to :limit due unkeyed pending messages of :destination (id, attempts, due
    time), in claim order, locked; built once."""
    m = messages.alias("m")
    return (
        sa.select(m.c.id, m.c.attempts, m.c.available_at)
        .where(
            m.c.state == state_literal(MessageState.PENDING),
            m.c.destination == sa.bindparam("destination", type_=sa.String()),
            m.c.ordering_key.is_(None),
            m.c.available_at <= pieces.bound_now(),
        )
        .order_by(m.c.available_at, m.c.id)
        .limit(limit_parameter())
        .with_for_update(skip_locked=True)
    )


@functools.cache
def lease_statement(pieces: DriverPieces) -> sa.Update:
    """Lease the :picked messages to :claim_owner; built once."""
    return (
        sa.update(messages)
        .where(by_keys(messages.c.id))
        .values(**claim_values(pieces.bound_now(), messages.c.attempts))
    )


@functools.cache
def read_claimed() -> sa.Select[Any]:
    """The claimed columns of the :picked messages."""
    return sa.select(*CLAIMED).where(by_keys(messages.c.id)).order_by(messages.c.id)


@functools.cache
def chain_statement(pieces: DriverPieces) -> sa.Select[Any]:
    """One key's next messages after its first, in id order, read without locks; built once.

    A locking walk would wait on every row it passes that another transaction holds: a
    relay settling another key's rows, an application still inserting into this key, for
    up to innodb_lock_wait_timeout, with the heads' locks held meanwhile. The walk reads
    what is committed, as a PostgreSQL claim's snapshot does; chain_lock then locks what
    it found by primary key.
    """
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


@functools.cache
def chain_lock() -> sa.Select[Any]:
    """Those of the :picked messages still pending, locked by primary key, skipping any
    another transaction holds (a chain is cut at the first one not returned)."""
    return (
        sa.select(messages.c.id)
        .where(by_keys(messages.c.id), messages.c.state == state_literal(MessageState.PENDING))
        .with_for_update(skip_locked=True)
    )


@functools.cache
def adopt_pick() -> sa.Select[Any]:
    """:claim_owner's messages still marked sending, locked."""
    return (
        sa.select(messages.c.id)
        .where(
            messages.c.state == state_literal(MessageState.SENDING),
            messages.c.owner == sa.bindparam("claim_owner", type_=sa.String()),
        )
        .with_for_update()
    )


@functools.cache
def adopt_statement(pieces: DriverPieces) -> sa.Update:
    """Re-lease the :picked messages under a new fence; built once."""
    now = pieces.bound_now()
    return (
        sa.update(messages)
        .where(by_keys(messages.c.id))
        .values(
            lease_until=now + sa.bindparam("lease", type_=sa.Double()), fence=messages.c.fence + 1
        )
    )


@functools.cache
def read_adopted() -> sa.Select[Any]:
    """The adopted messages as a claim returns them."""
    previous = (messages.c.attempts - 1).label("previous_attempts")
    return sa.select(*CLAIMED, previous).where(by_keys(messages.c.id)).order_by(messages.c.id)


@functools.cache
def reap_pick(pieces: DriverPieces) -> sa.Select[Any]:
    """Up to :limit messages whose delivery lease expired, locked, skipping locked ones."""
    return (
        sa.select(messages.c.id)
        .where(
            messages.c.state == state_literal(MessageState.SENDING),
            messages.c.lease_until <= pieces.bound_now(),
        )
        .limit(limit_parameter())
        .with_for_update(skip_locked=True)
    )


@functools.cache
def reap_statement(pieces: DriverPieces) -> sa.Update:
    """Return the :picked messages to pending; the relay then decides their fate."""
    return (
        sa.update(messages)
        .where(by_keys(messages.c.id))
        .values(
            state=MessageState.PENDING.value,
            lease_until=None,
            available_at=pieces.bound_now(),
            last_error="lease expired",
        )
    )


class MySQLClaims(DriverPieces):
    """Claim, chains, adopt and reap, each a locking pick, an UPDATE and a read."""

    def claim_session(self) -> str | None:
        """No session settings."""
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
        keys' next messages; `keys` holds where this relay's key walks go on from (its
        cursors, moved here)."""
        if limit <= 0:
            return []
        params = claim_parameters(owner, now, lease, limit, budget, destinations, skip_destinations)
        walk = KeyWalk() if keys is None else keys
        # As many keys' first messages as the limit allows, not KeyWalk.heads: each key's
        # chain here is a statement of its own, so a claim of many keys' first messages
        # costs fewer round trips than one of a few keys and their chains.
        taking = limit
        busy = set(skip_destinations)
        candidates: list[Any] = []
        moved: dict[str, str] = {}
        for destination in dict.fromkeys(destinations):
            if destination in busy:
                continue
            one = {**params, "destination": destination}
            candidates += conn.execute(unkeyed_pick(self), one).all()
            after = walk.cursors.get(destination, "")
            firsts, reached = self.first_of_keys(conn, after, one, taking)
            candidates += firsts
            if reached is not None:
                moved[destination] = reached
        candidates.sort(key=lambda row: (row.available_at, row.id))
        previous = {row.id: row.attempts for row in candidates[:limit]}
        heads = self.lease(conn, previous, params)
        chained = self.claim_chains(conn, heads, params)
        # Moved once the claim's statements ran: a claim tried again after a deadlock
        # walks from where the failed one began.
        walk.cursors.update(moved)
        return heads + chained

    def first_of_keys(
        self, conn: Connection, after: str, params: dict[str, Any], taking: int
    ) -> tuple[list[Any], str | None]:
        """Up to `taking` claimable first messages of the destination's keys after key
        `after` (wrapping past the last key), locked, in key order; and the key the next
        walk goes on after (None: no key has a pending message)."""
        cap = KEY_WALK * taking
        first = {**params, "after": after, "walk_cap": cap}
        walked = sorted(conn.execute(key_walk(), first).all())
        if len(walked) < cap and after:
            # Past the last key: on from the first, up to where this walk began.
            lap = {**params, "after": "", "walk_cap": cap - len(walked)}
            walked += sorted(row for row in conn.execute(key_walk(), lap) if row[0] <= after)
        if not walked:
            return [], None
        rank = {head: place for place, (_, head) in enumerate(walked) if head is not None}
        locked = sorted(
            conn.execute(head_lock(self), {**params, "picked": list(rank)}).all(),
            key=lambda row: rank[row.id],
        )
        taken = locked[:taking]
        # The next walk starts after the last key taken, or after every key visited.
        reached = taken[-1].ordering_key if len(taken) == taking else walked[-1][0]
        return taken, str(reached)

    def lease(
        self, conn: Connection, previous: dict[int, int], params: dict[str, Any]
    ) -> list[ClaimedRow]:
        """Lease the picked messages (id: attempts before the claim); their claimed rows."""
        rows = write_picked(conn, lease_statement(self), read_claimed(), list(previous), params)
        return [ClaimedRow._make((*row, previous[row.id])) for row in rows]

    def claim_chains(
        self, conn: Connection, heads: Sequence[ClaimedRow], params: dict[str, Any]
    ) -> list[ClaimedRow]:
        """Lease the next messages of the keys whose first messages were just leased."""
        keyed, room, share = chain_room(heads, params["limit"], params["budget"])
        if not keyed:
            return []
        chains: list[list[tuple[int, int]]] = []
        for head in keyed:
            walk = {
                **params,
                "destination": head.destination,
                "key": head.ordering_key,
                "head": head.id,
                "share": share,
            }
            chain: list[tuple[int, int]] = []
            for successor_id, attempts, ok in conn.execute(chain_statement(self), walk):
                if not ok:
                    break
                chain.append((successor_id, attempts))
            chains.append(chain)
        walked = [successor_id for chain in chains for successor_id, _ in chain]
        if not walked:
            return []
        # A message claimed or settled since the walk read it, or locked by another claim,
        # ends its chain there: a key's later messages never go without it.
        locked = set(picked(conn, chain_lock(), {"picked": walked}))
        chains = [_until_missing(chain, locked) for chain in chains]
        previous: dict[int, int] = {}
        for rank in range(max(len(c) for c in chains)):
            for chain in chains:
                if rank < len(chain) and len(previous) < room:
                    previous[chain[rank][0]] = chain[rank][1]
        return self.lease(conn, previous, params)

    def adopt_messages(
        self, conn: Connection, *, owner: str, now: Now, lease: float
    ) -> list[ClaimedRow]:
        """Re-lease this owner's messages still marked sending, under a new fence (see
        the portable adopt_messages for when it runs)."""
        params = {"now": now, "claim_owner": owner, "lease": lease}
        ids = picked(conn, adopt_pick(), params)
        rows = write_picked(conn, adopt_statement(self), read_adopted(), ids, params)
        return [ClaimedRow._make(row) for row in rows]

    def reap_expired_message_leases(self, conn: Connection, now: Now, limit: int) -> int:
        """Return up to `limit` messages whose delivery lease expired to pending; how many."""
        params = {"now": now, "limit": limit}
        ids = picked(conn, reap_pick(self), params)
        if ids:
            conn.execute(reap_statement(self), {**params, "picked": ids})
            conn.execute(record_expired(ids, self.now_sql(now)))
        return len(ids)


def _until_missing(chain: list[tuple[int, int]], locked: set[int]) -> list[tuple[int, int]]:
    """The chain's messages up to the first one not in `locked`."""
    for index, (successor_id, _) in enumerate(chain):
        if successor_id not in locked:
            return chain[:index]
    return chain
