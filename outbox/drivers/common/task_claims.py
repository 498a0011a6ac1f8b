"""Task claims in portable Core: pick the best claimable tasks, then lease them.

The claim is built once per driver and clock with bound parameters: SQLAlchemy then
reuses its compiled SQL, and building it anew for each call cost more CPU than the
database spent running it. It binds `now` only for a manual clock (see
claimable_pick).
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox.db.sql import limit_parameter, picked_once, state_literal
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import tasks
from outbox.states import TaskState

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
    tasks.c.traceparent,
    tasks.c.tracestate,
)


def running_tenants_at_cap() -> sa.Select[Any]:
    """The tenants already running :tenant_cap tasks."""
    running = tasks.alias("running")
    return (
        sa.select(running.c.tenant_id)
        .where(running.c.state == state_literal(TaskState.RUNNING))
        .group_by(running.c.tenant_id)
        .having(sa.func.count() >= sa.bindparam("tenant_cap", type_=sa.Integer()))
    )


def claim_now(pieces: DriverPieces, manual_clock: bool) -> sa.ColumnElement[float]:
    """The claim's "now": bound for a manual clock, else the database's clock in the SQL.

    With a bound `now`, PostgreSQL's generic plan walks the deadline index and sorts
    every unfinished task, where the database's clock written into the SQL keeps the
    walk in claim order (tests/test_claim_plans.py).
    """
    return sa.bindparam("now", type_=sa.Double()) if manual_clock else pieces.database_now()


def claimable_pick(now: sa.ColumnElement[float], capped: bool) -> sa.Select[Any]:
    """Up to :limit claimable task_ids in claim order: pending, due, not cancelled, inside
    their deadline; when `capped`, none of a tenant already running :tenant_cap tasks."""
    candidate = tasks.alias("candidate")
    pick = (
        sa.select(candidate.c.task_id)
        .where(
            candidate.c.state == state_literal(TaskState.PENDING),
            candidate.c.available_at <= now,
            candidate.c.cancel_requested_at.is_(None),
            candidate.c.deadline > now,
        )
        .order_by(candidate.c.priority.desc(), candidate.c.available_at, candidate.c.created_at)
        .limit(limit_parameter())
    )
    if capped:
        pick = pick.where(candidate.c.tenant_id.not_in(running_tenants_at_cap()))
    return pick


def lease_values(now: sa.ColumnElement[float]) -> dict[str, Any]:
    """The SET of a claim: running under :claim_owner for :lease, a new fence, an attempt."""
    return {
        "state": TaskState.RUNNING.value,
        "owner": sa.bindparam("claim_owner", type_=sa.String()),
        "lease_until": now + sa.bindparam("lease", type_=sa.Double()),
        "fence": tasks.c.fence + 1,
        "attempts": tasks.c.attempts + 1,
        "updated_at": now,
    }


def lease_update(now: sa.ColumnElement[float]) -> sa.Update:
    """The UPDATE that leases picked tasks to :claim_owner for :lease, RETURNING the claim."""
    return sa.update(tasks).values(**lease_values(now)).returning(*CLAIM_RETURNING)


@functools.cache
def claim_tasks_statement(pieces: DriverPieces, capped: bool, manual_clock: bool) -> Any:
    """Lease up to :limit claimable tasks to :claim_owner under a :lease: the picks, then
    the update of those still pending; built once."""
    now = claim_now(pieces, manual_clock)
    pick = claimable_pick(now, capped)
    return lease_update(now).where(
        tasks.c.task_id.in_(picked_once(pick, pieces.supports_skip_locked)),
        tasks.c.state == state_literal(TaskState.PENDING),
    )


class TaskClaimStatements(DriverPieces):
    """TaskClaimsDriver in Core: no session setting, no lock around capped claims (one
    writer at a time)."""

    def task_claim_session(self) -> str | None:
        """No setting: the portable claim needs none."""
        return None

    def task_claim_transaction_setting(self, conn: Connection) -> None:
        """No setting: the portable claim needs none."""

    def claim_tasks(
        self,
        conn: Connection,
        *,
        owner: str,
        now: float | None,
        lease: float,
        limit: int,
        tenant_cap: int | None = None,
    ) -> list[RowMapping]:
        """Lease up to `limit` of the best claimable tasks to `owner` (their rows in any
        order: RETURNING keeps none); with `tenant_cap`, none of a tenant already running
        that many (one by one: needs a transaction)."""
        capped = tenant_cap is not None
        statement = self.task_claim(capped, now is not None)
        params = {"now": now, "claim_owner": owner, "lease": lease, "limit": limit}
        if not capped:
            return list(conn.execute(statement, params).mappings())
        self.lock_tenant_caps(conn)
        # One at a time, so a batch cannot push a tenant past its cap.
        rows: list[RowMapping] = []
        for _ in range(limit):
            one = {**params, "limit": 1, "tenant_cap": tenant_cap}
            row = conn.execute(statement, one).mappings().first()
            if row is None:
                break
            rows.append(row)
        return rows

    def task_claim(self, capped: bool, manual_clock: bool) -> Any:
        """This backend's claim statement (claim_tasks_statement here)."""
        return claim_tasks_statement(self, capped, manual_clock)

    def lock_tenant_caps(self, conn: Connection) -> None:
        """Nothing: with one writer at a time, two claimers never race for a tenant's slot."""
