"""Statement pieces shared by every layer's statement builders.

Each state change is a guarded UPDATE whose WHERE clause names the state, the
owner and the fence; a statement that touches zero rows means the caller lost
its lease. "now" is always a parameter or the database clock (see dialect).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

Now = sa.ColumnElement[float]


def state_literal(name: str) -> sa.ColumnElement[str]:
    """A state name written into the SQL rather than bound as a parameter."""
    # A prepared statement's generic plan can then still prove a partial index's
    # `state = '...'` predicate and use it (tests/test_claim_plans.py).
    if not name.isidentifier():
        raise ValueError(f"not a state name: {name!r}")
    return sa.literal_column(f"'{name}'", sa.String())


def state_unindexed(column: sa.ColumnElement[str], name: str) -> sa.ColumnElement[bool]:
    """`column = name`, for a statement that finds its rows by primary key."""
    # Written so that no plan can prove a partial index's `state = '...'` predicate
    # from it, and so none walks such an index (every pending message, through an index
    # whose leading column is not the id) in place of the primary-key probes: with the
    # statistics of a table that had little pending, a plan did, for a second per claim
    # behind a backlog of 20,000 (tests/test_claim_plans.py).
    return column.op("||")(sa.literal_column("''")) == state_literal(name)


def picked_once(pick: sa.Select[Any], skip_locked: bool) -> Any:
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


def limit_parameter() -> sa.BindParameter[int]:
    """The :limit of a statement that takes at most that many rows."""
    return sa.bindparam("limit", type_=sa.Integer())


def select_now(now: Now) -> sa.Select[Any]:
    """Read the statement clock as a value."""
    return sa.select(now)
