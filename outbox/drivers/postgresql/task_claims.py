"""PostgreSQL's task claim: the picks as an array probed by primary key, in pick order, on
a connection without sorts or JIT; capped claims serialized by an advisory lock."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import Connection

from outbox.db.sql import state_unindexed
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.task_claims import (
    TaskClaimStatements,
    claim_now,
    claimable_pick,
    lease_update,
)
from outbox.schema import tasks
from outbox.states import TaskState

TASK_CLAIM_SETTING = (
    "SELECT set_config('enable_sort', 'off', {local}), set_config('jit', 'off', {local})"
)
"""The task claims' setting; `local` "true" for a claim inside a transaction of the pool's."""
# Without sorts: the pick then walks ix_outbox_tasks_claimable in claim order and stops
# at its limit. With statistics taken while no task was pending, both partial indexes
# of pending tasks look empty, and a plan walked ix_outbox_tasks_deadline (every
# unfinished task) and sorted, in generic and custom plans alike; no predicate the pick
# could test proves the claimable index's `state = 'pending'` without also proving the
# deadline index's `state IN ('pending', 'running')` (tests/test_claim_plans.py).
# Without JIT: the sort of the claimed rows into pick order then costs as a disabled
# sort, past jit_above_cost, and JIT would compile anew at every claim.
TASK_CLAIM_SESSION = TASK_CLAIM_SETTING.format(local="false")
"""The session setting of the connection task claims run on."""


@functools.cache
def claim_tasks_statement(pieces: DriverPieces, capped: bool, manual_clock: bool) -> Any:
    """Lease up to :limit claimable tasks to :claim_owner under a :lease, in pick order;
    built once. It runs under TASK_CLAIM_SESSION's setting."""
    now = claim_now(pieces, manual_clock)
    pick = claimable_pick(now, capped)
    # The picks as an array, found by primary-key probes, and a state test no partial
    # index's predicate follows from: with statistics taken while no task was pending,
    # `IN (picks) AND state = 'pending'` was a semi-join walking ix_outbox_tasks_deadline
    # (every unfinished task) at each claim (tests/test_claim_plans.py). The picks are
    # locked, so a row one of them names is still the one picked. The rows come back in
    # the pick's order, which probes by primary key would not keep.
    picked = pick.with_for_update(skip_locked=True).cte("picked").prefix_with("MATERIALIZED")
    ids = sa.func.array(sa.select(*picked.c).scalar_subquery())
    claimed = (
        lease_update(now)
        .where(tasks.c.task_id == sa.any_(ids), state_unindexed(tasks.c.state, TaskState.PENDING))
        .cte("claimed")
    )
    return sa.select(claimed).order_by(sa.func.array_position(ids, claimed.c.task_id))


@functools.cache
def claim_tasks_psycopg(pieces: DriverPieces, manual_clock: bool) -> tuple[str, dict[str, Any]]:
    """The uncapped claim as psycopg SQL text, with the values of its fixed parameters;
    :claim_owner, :lease, :limit (and :now) are bound per claim."""
    dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
    compiled = claim_tasks_statement(pieces, False, manual_clock).compile(dialect=dialect)
    return str(compiled), dict(compiled.params)


def lock_tenant_caps_statement() -> sa.Select[Any]:
    """The transaction's advisory lock that serializes capped claims."""
    return sa.select(sa.func.pg_advisory_xact_lock(sa.literal(0x6F7574626F78)))


class PostgreSQLTaskClaims(TaskClaimStatements):
    """Task claims on PostgreSQL: one statement in pick order, on a connection set up by
    TASK_CLAIM_SESSION."""

    def task_claim_session(self) -> str | None:
        """The session setting of the task claims' connection (TASK_CLAIM_SESSION)."""
        return TASK_CLAIM_SESSION

    def task_claim_transaction_setting(self, conn: Connection) -> None:
        """The claims' setting until the transaction of `conn` ends (SET LOCAL's scope);
        nothing in autocommit, where a claim runs on the claims' own connection."""
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            conn.exec_driver_sql(TASK_CLAIM_SETTING.format(local="true"))

    def task_claim(self, capped: bool, manual_clock: bool) -> Any:
        """PostgreSQL's claim statement (claim_tasks_statement here)."""
        return claim_tasks_statement(self, capped, manual_clock)

    def lock_tenant_caps(self, conn: Connection) -> None:
        """Row locks alone would let two claimers take one tenant's last slot: the
        transaction's advisory lock serializes capped claims."""
        conn.execute(lock_tenant_caps_statement())
