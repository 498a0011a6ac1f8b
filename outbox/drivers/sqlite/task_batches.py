"""SQLite's task batches: many tasks marked done, or many leases renewed, in one UPDATE
FROM a JSON document of their held triples (the SQL text is the same whatever the
batch size)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.task_renewals import RENEW_SET, TaskRenewalStatements, renewed
from outbox.drivers.common.task_results import COMPLETE_SET, TaskResultStatements
from outbox.drivers.common.task_transitions import held_in_v
from outbox.drivers.sqlite.clock import DATABASE_NOW
from outbox.drivers.task_interface import Completion, Held

SQLITE_NOW = f"COALESCE(:now, {DATABASE_NOW})"
"""The batches' "now": a manual clock's, else the database's."""
COMPLETE_SQLITE = sa.text(
    "UPDATE outbox_tasks SET"
    + COMPLETE_SET.format(now=SQLITE_NOW)
    + """FROM (
        SELECT json_extract(value, '$[0]') AS task_id, json_extract(value, '$[1]') AS owner,
               json_extract(value, '$[2]') AS fence, json_extract(value, '$[3]') AS result
        FROM json_each(:rows)
    ) AS v
    WHERE"""
    + held_in_v("outbox_tasks", SQLITE_NOW)
    + "RETURNING outbox_tasks.task_id"
)
"""Mark the held tasks of :rows done with their results; their task_ids."""
RENEW_SQLITE = sa.text(
    "UPDATE outbox_tasks SET "
    + RENEW_SET.format(now=SQLITE_NOW, lease=":lease")
    + """ FROM (
        SELECT json_extract(value, '$[0]') AS task_id, json_extract(value, '$[1]') AS owner,
               json_extract(value, '$[2]') AS fence
        FROM json_each(:rows)
    ) AS v
    WHERE"""
    + held_in_v("outbox_tasks", SQLITE_NOW)
    + """RETURNING outbox_tasks.task_id, outbox_tasks.owner, outbox_tasks.fence,
        outbox_tasks.lease_until"""
)
"""Extend each held lease of :rows by :lease."""


class SQLiteTaskBatches(TaskRenewalStatements, TaskResultStatements):
    """Results and renewals on SQLite: one statement each, from a JSON document."""

    def mark_done(
        self, conn: Connection, completions: Sequence[Completion], now: float | None
    ) -> set[str]:
        """Mark held tasks done with their results in one statement; the task_ids changed."""
        result = conn.execute(COMPLETE_SQLITE, {"rows": json.dumps(completions), "now": now})
        return set(result.scalars().all())

    def renew_leases(
        self, conn: Connection, held: Sequence[Held], lease: float, now: float | None
    ) -> dict[Held, float]:
        """Extend by `lease` each of `held` that still holds, in one statement."""
        if not held:
            return {}
        rows = conn.execute(RENEW_SQLITE, {"rows": json.dumps(held), "lease": lease, "now": now})
        return renewed(rows)
