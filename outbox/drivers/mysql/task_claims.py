"""Task claims on MySQL: the claimable tasks picked in claim order and locked (SKIP
LOCKED passes over those another worker is taking), leased by task_id, then read.

The pick walks ix_outbox_tasks_state_claimable (state, priority DESC, available_at,
created_at) in its order from the pending rows on and stops at its limit.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox.db.sql import state_literal
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.task_claims import (
    CLAIM_RETURNING,
    TaskClaimStatements,
    claim_now,
    claimable_pick,
    lease_values,
)
from outbox.drivers.mysql import tenant_lock
from outbox.drivers.mysql.picks import by_keys, picked, write_picked
from outbox.schema import tasks
from outbox.states import TaskState


@functools.cache
def task_pick(pieces: DriverPieces, capped: bool, manual_clock: bool) -> sa.Select[Any]:
    """Up to :limit claimable task_ids in claim order, locked; built once."""
    return claimable_pick(claim_now(pieces, manual_clock), capped).with_for_update(skip_locked=True)


@functools.cache
def task_lease(pieces: DriverPieces, manual_clock: bool) -> sa.Update:
    """Lease the :picked tasks to :claim_owner for :lease; built once."""
    now = claim_now(pieces, manual_clock)
    return (
        sa.update(tasks)
        .where(by_keys(tasks.c.task_id), tasks.c.state == state_literal(TaskState.PENDING))
        .values(**lease_values(now))
    )


@functools.cache
def read_claimed_tasks() -> sa.Select[Any]:
    """The claimed columns of the :picked tasks."""
    return sa.select(*CLAIM_RETURNING).where(by_keys(tasks.c.task_id))


class MySQLTaskClaims(TaskClaimStatements):
    """Claims as a locking pick, an UPDATE by task_id and a read."""

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
        """Lease up to `limit` of the best claimable tasks to `owner`; with `tenant_cap`,
        none of a tenant already running that many (one by one)."""
        manual = now is not None
        params: dict[str, Any] = {"now": now, "claim_owner": owner, "lease": lease}
        if tenant_cap is None:
            return self.lease_picked(conn, task_pick(self, False, manual), manual, params, limit)
        self.lock_tenant_caps(conn)
        # One at a time, so a batch cannot push a tenant past its cap.
        rows: list[RowMapping] = []
        capped = {**params, "tenant_cap": tenant_cap}
        for _ in range(limit):
            one = self.lease_picked(conn, task_pick(self, True, manual), manual, capped, 1)
            if not one:
                break
            rows += one
        return rows

    def lease_picked(
        self, conn: Connection, pick: Any, manual: bool, params: dict[str, Any], limit: int
    ) -> list[RowMapping]:
        """Pick up to `limit` tasks, lease them, read them back."""
        ids = picked(conn, pick, {**params, "limit": limit})
        rows = write_picked(conn, task_lease(self, manual), read_claimed_tasks(), ids, params)
        return [row._mapping for row in rows]

    def lock_tenant_caps(self, conn: Connection) -> None:
        """Serialize capped claims until their transaction has ended (tenant_lock)."""
        tenant_lock.lock_tenant_caps(conn)
