"""PostgreSQL's renewal of many task leases: one statement of arrays, rows locked by a
write under way skipped."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.engine import Connection

from outbox.drivers.common.task_renewals import RENEW_SET, TaskRenewalStatements, renewed
from outbox.drivers.common.task_transitions import held_in_v
from outbox.drivers.execution import UNPREPARED
from outbox.drivers.postgresql.task_results import PG_NOW
from outbox.drivers.task_interface import Held

# A row locked right now (its finish or failure being written) is skipped, not waited
# for: waiting in one multi-row statement while a batch of finishes waits on another is
# a deadlock, and a row being finished needs no renewal (if that write rolls back, the
# next beat renews). Each row is found by one primary-key probe and updated by ctid, as
# a batch of results is (outbox.drivers.postgresql.task_results): joined on the arrays,
# with statistics taken while few tasks ran, a plan walked every running task of every
# worker at each beat. A row another transaction changed since the statement began may
# be left out, like a locked one: TaskQueue.renew_many then reads whether it is still
# held. Planned per run, as the results batch is (see UNPREPARED there).
RENEW_POSTGRESQL = (
    """WITH v AS (
        SELECT * FROM unnest(
            CAST(%(task_ids)s AS varchar[]), CAST(%(owners)s AS varchar[]),
            CAST(%(fences)s AS bigint[])
        ) AS v(task_id, owner, fence)
    ), held AS MATERIALIZED (
        SELECT probe.row_id FROM v CROSS JOIN LATERAL (
            SELECT t.ctid AS row_id FROM outbox_tasks AS t WHERE"""
    + held_in_v("t", PG_NOW, unindexed=True)
    + """LIMIT 1 FOR UPDATE OF t SKIP LOCKED
        ) AS probe
    )
    UPDATE outbox_tasks AS t SET """
    + RENEW_SET.format(now=PG_NOW, lease="%(lease)s::float8")
    + """
    FROM held WHERE t.ctid = held.row_id
    RETURNING t.task_id, t.owner, t.fence, t.lease_until"""
)
"""Extend each held lease of the arrays by %(lease)s, skipping rows locked by a write."""


class PostgreSQLTaskRenewals(TaskRenewalStatements):
    """Renewals on PostgreSQL: one statement of arrays."""

    def renew_leases(
        self, conn: Connection, held: Sequence[Held], lease: float, now: float | None
    ) -> dict[Held, float]:
        """Extend by `lease` each of `held` that still holds, in one statement; rows locked
        by a write under way are skipped, not waited for."""
        if not held:
            return {}
        task_ids, owners, fences = (list(c) for c in zip(*held, strict=True))
        params = {"task_ids": task_ids, "owners": owners, "fences": fences}
        result = conn.exec_driver_sql(
            RENEW_POSTGRESQL,
            {**params, "lease": lease, "now": now},
            execution_options={UNPREPARED: True},
        )
        return renewed(result)
