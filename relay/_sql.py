"""The relay's statements: claim deliverable messages, settle outcomes by group.

Settling is one guarded statement per outcome group: the WHERE clause names
each row's (id, fence) pair, the state `sending` and the owner, so a stale
relay's write touches nothing. Per-row values ride in CASE expressions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

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


def claim_messages(
    *,
    owner: str,
    now: Now,
    lease: float,
    limit: int,
    budget: int,
    skip_locked: bool,
    resolve: bool,
) -> sa.Update:
    """Lease due pending messages: to deliver (attempts left) or, with `resolve`, to settle.

    Messages whose attempts are spent only reach `pending` again when their
    lease expired mid-send; they are claimed to resolve their outcome, never
    to send again.
    """
    m = messages.alias("m")
    spent = m.c.attempts >= budget
    pick = (
        sa.select(m.c.id)
        .where(
            m.c.state == "pending",
            m.c.available_at <= now,
            spent if resolve else ~spent,
            _first_undelivered_of_its_key(m),
        )
        .order_by(m.c.available_at, m.c.id)
        .limit(limit)
    )
    chosen: Any = pick.scalar_subquery()
    if skip_locked:
        # Materialized, so PostgreSQL runs the LIMIT ... SKIP LOCKED pick once; as an
        # IN (subquery) a nested-loop plan may rescan it and take far more than `limit`.
        picked = pick.with_for_update(skip_locked=True).cte("picked").prefix_with("MATERIALIZED")
        chosen = sa.select(picked.c.id)
    return (
        sa.update(messages)
        .where(messages.c.id.in_(chosen), messages.c.state == "pending")
        .values(
            state="sending",
            owner=owner,
            lease_until=now + lease,
            fence=messages.c.fence + 1,
            attempts=messages.c.attempts if resolve else messages.c.attempts + 1,
        )
        .returning(*CLAIMED)
    )


def _held(owner: str, fences: Mapping[int, int]) -> sa.ColumnElement[bool]:
    return sa.and_(
        sa.tuple_(messages.c.id, messages.c.fence).in_(list(fences.items())),
        messages.c.state == "sending",
        messages.c.owner == owner,
    )


def _per_row(values: Mapping[int, Any], type_: Any, else_: Any = None) -> Any:
    # The cast gives PostgreSQL a type for a CASE whose branches may all be NULL.
    return sa.cast(sa.case(dict(values), value=messages.c.id, else_=else_), type_)


def settle_sent(
    owner: str, fences: Mapping[int, int], statuses: Mapping[int, int | None], now: Now
) -> sa.Update:
    """Mark held messages sent."""
    return (
        sa.update(messages)
        .where(_held(owner, fences))
        .values(
            state="sent",
            sent_at=now,
            lease_until=None,
            last_error=None,
            last_status=_per_row(statuses, sa.Integer()),
        )
        .returning(messages.c.id)
    )


def settle_retry(
    owner: str,
    fences: Mapping[int, int],
    delays: Mapping[int, float],
    statuses: Mapping[int, int | None],
    errors: Mapping[int, str],
    now: Now,
) -> sa.Update:
    """Return held messages to pending, each due after its own delay."""
    return (
        sa.update(messages)
        .where(_held(owner, fences))
        .values(
            state="pending",
            available_at=now + _per_row(delays, sa.Double(), 0.0),
            lease_until=None,
            last_status=_per_row(statuses, sa.Integer()),
            last_error=_per_row(errors, sa.Text()),
        )
        .returning(messages.c.id)
    )


def settle_dead(
    owner: str,
    fences: Mapping[int, int],
    statuses: Mapping[int, int | None],
    errors: Mapping[int, str],
) -> sa.Update:
    """Mark held messages dead with their status and error kept."""
    return (
        sa.update(messages)
        .where(_held(owner, fences))
        .values(
            state="dead",
            lease_until=None,
            last_status=_per_row(statuses, sa.Integer()),
            last_error=_per_row(errors, sa.Text()),
        )
        .returning(messages.c.id)
    )


def select_states(ids: Sequence[int]) -> sa.Select[Any]:
    """Re-read state, owner and fence of messages (to resolve an uncertain commit)."""
    return sa.select(messages.c.id, messages.c.state, messages.c.owner, messages.c.fence).where(
        messages.c.id.in_(list(ids))
    )


def backlog(now: Now) -> Any:
    """How many messages are undelivered, and the age of the oldest (None when none)."""
    undelivered = messages.c.state.in_(("pending", "sending"))
    return sa.select(sa.func.count(), now - sa.func.min(messages.c.created_at)).where(undelivered)
