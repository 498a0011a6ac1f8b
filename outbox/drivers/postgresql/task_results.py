"""PostgreSQL's task results: a batch marked done and its replies inserted in one statement
of arrays (through psycopg; other drivers of the caller's take the portable statements).
The arrays go in binary (%(name)b): encoded as text, a batch of ten cost the worker about
twice the client CPU (bytea bodies escaped, every element quoted).

The SQL text is the same whatever the batch size, and its plan does not depend on it:
psycopg prepares it once run often, as it does the claim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from outbox.drivers.common.task_results import COMPLETE_SET, TaskResultStatements
from outbox.drivers.common.task_transitions import held_in_v
from outbox.drivers.postgresql.receipts import STATEMENT_NOW
from outbox.drivers.task_interface import Completion

PG_NOW = f"COALESCE(%(now)s::float8, {STATEMENT_NOW})"
"""The batches' "now": a manual clock's, else the statement's time."""
# Each row of the batch finds its task by one primary-key probe (the LATERAL subquery,
# which its LIMIT keeps from being flattened into a join the planner may reorder), and
# the UPDATE then goes straight to that row version by ctid. Joined on the batch
# instead, with statistics taken while few tasks ran, a plan walked
# ix_outbox_tasks_running_tenant, every running task of every worker, at each batch
# (7 ms for 10 results beside 3,000 running tasks, against 0.3 ms); with the state test
# unindexed and still joined, a plan rescanned the batch once per task in the table
# (4.6 s for 500 results beside 20,000). The shape leaves a generic plan nothing to
# guess, so the statement is prepared like any other (tests/test_claim_plans.py). A row
# changed by another transaction since the probe has another ctid: the UPDATE then
# leaves it, and the completer writes that result alone.
# The replies are written in the same statement, from what the UPDATE returns: one round
# trip for a whole batch, and atomic alone.
COMPLETE_POSTGRESQL = (
    """WITH v AS (
        SELECT * FROM unnest(
            CAST(%(task_ids)b AS varchar[]), CAST(%(owners)b AS varchar[]),
            CAST(%(fences)b AS bigint[]), CAST(%(results)b AS text[]),
            CAST(%(reply_ids)b AS varchar[]), CAST(%(destinations)b AS varchar[]),
            CAST(%(bodies)b AS bytea[]), CAST(%(hashes)b AS varchar[]),
            CAST(%(headers)b AS text[])
        ) AS v(task_id, owner, fence, result, reply_id, destination, body, content_hash,
            headers)
    ), held AS MATERIALIZED (
        SELECT v.*, probe.row_id FROM v CROSS JOIN LATERAL (
            SELECT t.ctid AS row_id FROM outbox_tasks AS t WHERE"""
    + held_in_v("t", PG_NOW, unindexed=True)
    + """LIMIT 1
        ) AS probe
    ), done AS (
        UPDATE outbox_tasks AS t SET"""
    + COMPLETE_SET.format(now=PG_NOW)
    + "FROM held AS v WHERE t.ctid = v.row_id AND"
    + held_in_v("t", PG_NOW, unindexed=True)
    + """RETURNING t.task_id, v.reply_id, v.destination, v.body, v.content_hash, v.headers
    ), replies AS (
        INSERT INTO outbox_messages (reply_id, task_id, destination, body, content_hash,
            headers, state, attempts, fence, available_at, created_at)
        SELECT reply_id, task_id, destination, body, content_hash,
            COALESCE(headers, '{}'), 'pending', 0, 0, """
    + PG_NOW
    + ", "
    + PG_NOW
    + """
        FROM done
    )
    SELECT task_id FROM done"""
)
"""Mark held tasks done and insert the replies of those it changed; their task_ids."""


def complete_parameters(
    completions: Sequence[Completion], replies: Sequence[Mapping[str, Any]], now: float | None
) -> dict[str, Any]:
    """COMPLETE_POSTGRESQL's parameters: the completions and their reply rows as arrays."""
    task_ids, owners, fences, results = (list(c) for c in zip(*completions, strict=True))
    headers = [row["headers"] for row in replies]
    return {
        "task_ids": task_ids,
        "owners": owners,
        "fences": fences,
        "results": results,
        "reply_ids": [row["reply_id"] for row in replies],
        "destinations": [row["destination"] for row in replies],
        "bodies": [row["body"] for row in replies],
        "hashes": [row["content_hash"] for row in replies],
        # Replies carry headers only when traced: no array to encode otherwise (unnest pads
        # the missing column with NULLs).
        "headers": headers if any(h != "{}" for h in headers) else None,
        "now": now,
    }


class PostgreSQLTaskResults(TaskResultStatements):
    """Task results on PostgreSQL: one statement of arrays through psycopg."""

    def complete_tasks(
        self,
        conn: Connection,
        completions: Sequence[Completion],
        replies: Sequence[Mapping[str, Any]],
        now: float | None,
    ) -> set[str]:
        """Mark held tasks done and insert the replies of those it changed in one statement
        (psycopg's SQL; asyncpg or psycopg2 connections of a caller's take the portable
        statements); the task_ids it changed."""
        if conn.dialect.driver != "psycopg":
            return super().complete_tasks(conn, completions, replies, now)
        if not completions:
            return set()
        params = complete_parameters(completions, replies, now)
        result = conn.exec_driver_sql(COMPLETE_POSTGRESQL, params)
        return set(result.scalars().all())
