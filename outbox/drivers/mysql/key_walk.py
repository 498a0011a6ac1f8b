"""MySQL's walk of a destination's ordering keys: the keys with a pending message in key
order, each with its first message, then those first messages locked and checked.

The walk passes index entries alone (a long key's where it crosses that key) and never
tests the messages held back behind their key's first one by one. The next walk goes
on after the key this one reached (outbox.drivers.records.KeyWalk's cursors).
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import sqlalchemy as sa

from outbox.db.sql import state_literal
from outbox.ddl import MYSQL_ROUTABLE, innodb_name
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.mysql.picks import by_keys
from outbox.schema import messages
from outbox.states import MessageState

T = TypeVar("T", sa.Select[Any], sa.Exists)
MYSQL_ORDERING = innodb_name("ix_outbox_messages_ordering")
"""(destination, ordering_key, state, id): a key's messages of one state in id order."""


def forcing(statement: T, table: Any, index: str) -> T:
    """`statement` reading `table` along `index` alone, on MySQL and MariaDB."""
    hint = f"FORCE INDEX ({index})"
    forced: T = statement.with_hint(table, hint, "mysql").with_hint(table, hint, "mariadb")
    return forced


@functools.cache
def key_walk() -> sa.Select[Any]:
    """Up to :walk_cap keys of :destination with a pending message, after :after, each with
    its lowest pending id, read without locks.

    The keys are read in key order along ix_outbox_messages_state_routable, whose range
    of the destination's keyed pending messages is ordered by key, and the read stops at
    the cap: it passes a long key's entries once, where a claim's walk crosses that key,
    never the other keys' backlogs. (A loose index scan, one entry per key, is the
    optimizer's to choose by its statistics: with many short keys it scanned every key's
    entries, then sorted them, at every claim.) Each key's lowest pending id is one probe
    of ix_outbox_messages_state_ordering (equal to the key, LIMIT 1). Rows come in no set
    order.
    """
    m = messages.alias("m")
    destination = sa.bindparam("destination", type_=sa.String())
    in_key_order = (
        sa.select(m.c.ordering_key)
        .distinct()
        .where(
            m.c.state == state_literal(MessageState.PENDING),
            m.c.destination == destination,
            m.c.ordering_key > sa.bindparam("after", type_=sa.String()),
        )
        .order_by(m.c.ordering_key)
        .limit(sa.bindparam("walk_cap", type_=sa.Integer()))
    )
    # ix_outbox_messages_state_ordering (destination, ordering_key, ...) also reads in key
    # order, but through every key's delivered history: the pending range, named.
    keys = forcing(in_key_order, m, MYSQL_ROUTABLE).subquery("walked")
    h = messages.alias("h")
    lowest = (
        sa.select(h.c.id)
        .where(
            h.c.destination == destination,
            h.c.ordering_key == keys.c.ordering_key,
            h.c.state == state_literal(MessageState.PENDING),
        )
        .order_by(h.c.id)
        .limit(1)
    )
    # Named too: by its estimates the optimizer took the routable index, whose key range
    # is in due-time order, and sorted a long key's every pending entry.
    head = forcing(lowest, h, MYSQL_ORDERING).scalar_subquery()
    return sa.select(keys.c.ordering_key, head.label("head"))


def earlier_of_its_key(m: Any, state: MessageState) -> sa.Exists:
    """A lower id of message `m`'s key is in `state`: one probe of the ordering index.

    One state at a time, as an equality: with `state IN (pending, sending)` InnoDB
    narrowed the probe by destination and key alone, through the key's delivered history.
    """
    earlier = messages.alias(f"earlier_{state.value}")
    exists = sa.exists().where(
        earlier.c.destination == m.c.destination,
        earlier.c.ordering_key == m.c.ordering_key,
        earlier.c.state == state_literal(state),
        earlier.c.id < m.c.id,
    )
    return forcing(exists, earlier, MYSQL_ORDERING)


@functools.cache
def head_lock(pieces: DriverPieces) -> sa.Select[Any]:
    """Those of the :picked messages still pending, due and their key's first
    undelivered, locked by primary key, skipping any another transaction holds."""
    m = messages.alias("m")
    return (
        sa.select(m.c.id, m.c.attempts, m.c.available_at, m.c.ordering_key)
        .where(
            by_keys(m.c.id),
            m.c.state == state_literal(MessageState.PENDING),
            m.c.available_at <= pieces.bound_now(),
            ~earlier_of_its_key(m, MessageState.PENDING),
            ~earlier_of_its_key(m, MessageState.SENDING),
        )
        .with_for_update(skip_locked=True)
    )
