"""Statement builders: every query the outbox runs, named for what it does.

Each state change is a guarded UPDATE whose WHERE clause names the state,
the owner and the fence; a statement that touches zero rows means the caller
lost its lease. "now" is always a parameter (database clock or manual clock).
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from outbox._dialect import insert_ignoring_conflicts
from outbox.clock import bound_now
from outbox.schema import inbox, messages, tasks

Now = sa.ColumnElement[float]

CLAIM_RETURNING = (
    tasks.c.task_id,
    tasks.c.owner,
    tasks.c.fence,
    tasks.c.attempts,
    tasks.c.payload,
    tasks.c.lease_until,
    tasks.c.deadline,
    tasks.c.tenant_id,
    tasks.c.priority,
    tasks.c.available_at,
    tasks.c.created_at,
)


def select_now(now: Now) -> sa.Select[Any]:
    """Read the statement clock as a value."""
    return sa.select(now)


# --- intake -----------------------------------------------------------------


def insert_inbox(dialect_name: str) -> Any:
    """Insert an inbox row, doing nothing when (principal, message_id) is already stored."""
    return insert_ignoring_conflicts(inbox, dialect_name)


def select_inbox_hash(principal: str, message_id: str) -> sa.Select[Any]:
    """The stored content hash and task of one inbox message."""
    return sa.select(inbox.c.content_hash, inbox.c.task_id).where(
        inbox.c.principal == principal, inbox.c.message_id == message_id
    )


def insert_task() -> sa.Insert:
    """Insert one task row."""
    return sa.insert(tasks)


# --- claiming ---------------------------------------------------------------


def _running_tenants_at_cap(cap: int) -> sa.Select[Any]:
    running = tasks.alias("running")
    return (
        sa.select(running.c.tenant_id)
        .where(running.c.state == "running")
        .group_by(running.c.tenant_id)
        .having(sa.func.count() >= cap)
    )


def _picked_once(pick: sa.Select[Any], skip_locked: bool) -> Any:
    """The chosen keys (the pick's only column), computed exactly once.

    PostgreSQL may plan `IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)` as a
    nested-loop semi-join that rescans the subquery for every outer row; each
    rescan skips the rows this statement already updated and picks the next
    ones, so the UPDATE takes far more than `limit` rows. A MATERIALIZED CTE is
    evaluated once and its rescans read the stored result.
    """
    if not skip_locked:
        return pick.scalar_subquery()
    picked = pick.with_for_update(skip_locked=True).cte("picked").prefix_with("MATERIALIZED")
    return sa.select(*picked.c)


def state_literal(name: str) -> sa.ColumnElement[str]:
    """A state name written into the SQL rather than bound as a parameter."""
    # A prepared statement's generic plan can then still prove a partial index's
    # `state = '...'` predicate and use it (tests/test_claim_plans.py).
    if not name.isidentifier():
        raise ValueError(f"not a state name: {name!r}")
    return sa.literal_column(f"'{name}'", sa.String())


def claim_tasks(
    *, owner: str, now: Now, lease: float, limit: int, skip_locked: bool, tenant_cap: int | None
) -> sa.Update:
    """Take the best claimable tasks: pending, due, not cancelled, inside their deadline."""
    candidate = tasks.alias("candidate")
    pick = (
        sa.select(candidate.c.task_id)
        .where(
            candidate.c.state == state_literal("pending"),
            candidate.c.available_at <= now,
            candidate.c.cancel_requested_at.is_(None),
            candidate.c.deadline > now,
        )
        .order_by(candidate.c.priority.desc(), candidate.c.available_at, candidate.c.created_at)
        .limit(limit)
    )
    if tenant_cap is not None:
        pick = pick.where(candidate.c.tenant_id.not_in(_running_tenants_at_cap(tenant_cap)))
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id.in_(_picked_once(pick, skip_locked)),
            tasks.c.state == state_literal("pending"),
        )
        .values(
            state="running",
            owner=owner,
            lease_until=now + lease,
            fence=tasks.c.fence + 1,
            attempts=tasks.c.attempts + 1,
            updated_at=now,
        )
        .returning(*CLAIM_RETURNING)
    )


def lock_tenant_caps() -> sa.Select[Any]:
    """Serialize capped claims on PostgreSQL: two claimers never take one tenant's last slot."""
    return sa.select(sa.func.pg_advisory_xact_lock(sa.literal(0x6F7574626F78)))


# --- ownership-guarded transitions -------------------------------------------


def _held(task_id: str, owner: str, fence: int, now: Now) -> sa.ColumnElement[bool]:
    return sa.and_(
        tasks.c.task_id == task_id,
        tasks.c.state == "running",
        tasks.c.owner == owner,
        tasks.c.fence == fence,
        tasks.c.lease_until > now,
        tasks.c.deadline > now,
    )


def renew_lease(task_id: str, owner: str, fence: int, now: Now, lease: float) -> sa.Update:
    """Extend a lease that still holds."""
    return (
        sa.update(tasks)
        .where(_held(task_id, owner, fence, now))
        .values(lease_until=now + lease, updated_at=now)
        .returning(tasks.c.lease_until)
    )


def complete_task(task_id: str, owner: str, fence: int, now: Now, result: str) -> sa.Update:
    """Mark a held task done with its result."""
    return (
        sa.update(tasks)
        .where(_held(task_id, owner, fence, now))
        .values(state="done", result=result, lease_until=None, finished_at=now, updated_at=now)
    )


def fail_task(
    task_id: str, owner: str, fence: int, now: Now, *, reason: str, permanent: bool, delay: float
) -> sa.Update:
    """Send a held task back to pending after `delay`, or to failed when it has no attempts left."""
    final = sa.or_(sa.literal(permanent), tasks.c.attempts >= tasks.c.max_attempts)
    return (
        sa.update(tasks)
        .where(_held(task_id, owner, fence, now))
        .values(
            state=sa.case((final, "failed"), else_="pending"),
            available_at=sa.case((final, tasks.c.available_at), else_=now + delay),
            finished_at=sa.case((final, now), else_=None),
            lease_until=None,
            last_error=reason,
            updated_at=now,
        )
        .returning(tasks.c.state)
    )


def cancel_task(task_id: str, now: Now) -> sa.Update:
    """Cancel a pending or running task at once."""
    return (
        sa.update(tasks)
        .where(tasks.c.task_id == task_id, tasks.c.state.in_(("pending", "running")))
        .values(
            state="cancelled",
            cancel_requested_at=now,
            lease_until=None,
            finished_at=now,
            updated_at=now,
        )
    )


def select_task(task_id: str) -> sa.Select[Any]:
    """One task row."""
    return sa.select(tasks).where(tasks.c.task_id == task_id)


# --- reconciliation -----------------------------------------------------------


def expire_past_deadline(now: Now, limit: int, skip_locked: bool) -> sa.Update:
    """Move pending or running tasks whose deadline has passed to expired."""
    pick = tasks.alias("pick")
    chosen = (
        sa.select(pick.c.task_id)
        .where(pick.c.state.in_(("pending", "running")), pick.c.deadline <= now)
        .limit(limit)
    )
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id.in_(_picked_once(chosen, skip_locked)),
            tasks.c.state.in_(("pending", "running")),
        )
        .values(
            state="expired",
            lease_until=None,
            last_error="deadline passed",
            finished_at=now,
            updated_at=now,
        )
        .returning(tasks.c.task_id)
    )


def reap_expired_task_leases(now: Now, limit: int, skip_locked: bool) -> sa.Update:
    """Return running tasks whose lease expired to pending, or fail them when out of attempts."""
    pick = tasks.alias("pick")
    chosen = (
        sa.select(pick.c.task_id)
        .where(pick.c.state == "running", pick.c.lease_until <= now)
        .limit(limit)
    )
    exhausted = tasks.c.attempts >= tasks.c.max_attempts
    return (
        sa.update(tasks)
        .where(tasks.c.task_id.in_(_picked_once(chosen, skip_locked)), tasks.c.state == "running")
        .values(
            state=sa.case((exhausted, "failed"), else_="pending"),
            last_error=sa.case((exhausted, "attempts exhausted"), else_="lease expired"),
            finished_at=sa.case((exhausted, now), else_=None),
            available_at=now,
            lease_until=None,
            updated_at=now,
        )
        .returning(tasks.c.task_id, tasks.c.state)
    )


def reap_expired_message_leases(now: Now, limit: int, skip_locked: bool) -> sa.Update:
    """Return messages whose delivery lease expired to pending; the relay decides their fate."""
    pick = messages.alias("pick")
    chosen = (
        sa.select(pick.c.id)
        .where(pick.c.state == "sending", pick.c.lease_until <= now)
        .limit(limit)
    )
    return (
        sa.update(messages)
        .where(messages.c.id.in_(_picked_once(chosen, skip_locked)), messages.c.state == "sending")
        .values(state="pending", lease_until=None, available_at=now, last_error="lease expired")
        .returning(messages.c.id)
    )


# --- messages ---------------------------------------------------------------


def insert_messages(now: Now, ignore_conflicts: str | None = None) -> Any:
    """Insert outbox messages as pending and due now; optionally skip an existing reply_id."""
    if ignore_conflicts is None:
        statement: Any = sa.insert(messages)
    else:
        statement = insert_ignoring_conflicts(messages, ignore_conflicts)
    return statement.values(state="pending", attempts=0, fence=0, available_at=now, created_at=now)


@functools.cache
def insert_one_message(dialect_name: str) -> Any:
    """INSERT one message unless its reply_id exists, RETURNING the row; built once.

    Bind `now` to a manual clock's time, or None for the database's clock.
    """
    return insert_messages(bound_now(dialect_name), ignore_conflicts=dialect_name).returning(
        *messages.c
    )


def select_message(reply_id: str) -> sa.Select[Any]:
    """One message row by reply_id."""
    return sa.select(messages).where(messages.c.reply_id == reply_id)


def select_messages(state: str | None, limit: int | None) -> sa.Select[Any]:
    """Messages in sequence order, optionally of one state."""
    query = sa.select(messages).order_by(messages.c.id)
    if state is not None:
        query = query.where(messages.c.state == state)
    if limit is not None:
        query = query.limit(limit)
    return query
