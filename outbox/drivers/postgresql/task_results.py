"""PostgreSQL's task results: a batch marked done and its replies inserted in one statement
of arrays, and one more for the rows it left (through psycopg; other drivers of the
caller's take the portable statements).
The arrays go in binary (%(name)b): encoded as text, a batch of ten cost the worker about
twice the client CPU (bytea bodies escaped, every element quoted).

The SQL text is the same whatever the batch size. It is planned per run (see
outbox.drivers.execution.UNPREPARED and COMPLETE_POSTGRESQL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from outbox.drivers.common.task_results import COMPLETE_SET, TaskResultStatements
from outbox.drivers.common.task_transitions import held_in_v
from outbox.drivers.execution import UNPREPARED
from outbox.drivers.postgresql.receipts import STATEMENT_NOW
from outbox.drivers.task_interface import Completion

PG_NOW = f"COALESCE(%(now)s::float8, {STATEMENT_NOW})"
"""The batches' "now": a manual clock's, else the statement's time."""
# Each row of the batch finds its task by one primary-key probe (the LATERAL subquery,
# which its LIMIT keeps from being flattened into a join the planner may reorder); the
# UPDATE then goes to that row version by ctid and tests the held guard there. Joined on
# the batch instead, with statistics taken while few tasks ran, a plan walked
# ix_outbox_tasks_running_tenant, every running task of every worker, at each batch
# (7 ms for 10 results beside 3,000 running tasks, against 0.3 ms); with the state test
# unindexed and still joined, a plan rescanned the batch once per task in the table
# (4.6 s for 500 results beside 20,000). It is planned per run (UNPREPARED): a generic
# plan cached while the table was small keeps its sequential scans once it has grown.
# A row another transaction changed after the statement began (a heartbeat's renewal,
# say) may be left by the ctid join, still held: the rows a run left are tried once
# more (left_parameters), in a statement that sees the change. A second change within
# that one (heartbeats come a third of a lease apart) would leave it refused here; the
# worker then writes it alone, which tries twice again.
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
            SELECT t.ctid AS row_id FROM outbox_tasks AS t WHERE t.task_id = v.task_id LIMIT 1
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


def left_parameters(
    completions: Sequence[Completion],
    replies: Sequence[Mapping[str, Any]],
    now: float | None,
    done: set[str],
) -> dict[str, Any] | None:
    """COMPLETE_POSTGRESQL's parameters for the completions a run left undone (None when it
    did them all), for a second run that sees rows changed while the first ran."""
    left = [index for index, completion in enumerate(completions) if completion[0] not in done]
    if not left:
        return None
    return complete_parameters(
        [completions[index] for index in left], [replies[index] for index in left], now
    )


class PostgreSQLTaskResults(TaskResultStatements):
    """Task results on PostgreSQL: one statement of arrays through psycopg."""

    def complete_tasks(
        self,
        conn: Connection,
        completions: Sequence[Completion],
        replies: Sequence[Mapping[str, Any]],
        now: float | None,
    ) -> set[str]:
        """Mark held tasks done and insert the replies of those it changed in one statement,
        and one more for the rows it left (psycopg's SQL; asyncpg or psycopg2 connections
        of a caller's take the portable statements); the task_ids they changed."""
        if conn.dialect.driver != "psycopg":
            return super().complete_tasks(conn, completions, replies, now)
        if not completions:
            return set()
        done = complete_run(conn, complete_parameters(completions, replies, now))
        again = left_parameters(completions, replies, now, done)
        return done if again is None else done | complete_run(conn, again)


def complete_run(conn: Connection, params: Mapping[str, Any]) -> set[str]:
    """One run of COMPLETE_POSTGRESQL on `conn`; the task_ids it marked done."""
    result = conn.exec_driver_sql(COMPLETE_POSTGRESQL, params, execution_options={UNPREPARED: True})
    return set(result.scalars().all())
