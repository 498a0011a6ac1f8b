"""The worker's claims and result batches on held psycopg connections (PostgreSQL).

A busy worker claims and commits results many times a second, as coroutines of its
HandlerLoop. Through psycopg they run there too, each stream on a held async
connection (outbox.db.async_lane): the same statements as TaskQueue.claim_many and
TaskQueue.finish_many, with the same failpoints around them, and no hop to a
thread and back per claim or batch. They connect from the URL the queue was opened
with: a queue on an engine of the caller's, whose settings may live outside its URL
(connect_args, a creator, a token hook), goes through TaskQueue instead
(`psycopg_conninfo` says which). The producer claims with PsycopgClaims, the
completer commits batches with PsycopgFinishes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outbox import failpoints, task_results
from outbox.claim import Claim, claims_from_rows
from outbox.db import task_sql
from outbox.db.async_lane import AsyncLane
from outbox.db.dialect import clock_value, listen_conninfo
from outbox.tasks import TaskQueue


def psycopg_conninfo(queue: TaskQueue) -> str | None:
    """The connection string to hold connections of `queue` with, where they apply."""
    engine = queue.engine
    conninfo = listen_conninfo(engine)
    if conninfo is not None and engine.dialect.driver == "psycopg" and queue.owns_engine:
        return conninfo
    return None


class PsycopgClaims:
    """Claims in one autocommit statement on a held connection, as claim_many's."""

    def __init__(self, queue: TaskQueue, owner: str, conninfo: str) -> None:
        """The connection opens from `conninfo` at the first claim."""
        self.queue = queue
        self.owner = owner
        self._lane = AsyncLane(conninfo, task_sql.claim_session("postgresql"))

    async def claim(self, limit: int) -> list[Claim]:
        """Lease up to `limit` tasks to the owner (the claim must be one statement:
        TaskQueue.claim_is_one_statement)."""
        now = clock_value(self.queue.clock)
        sql, fixed = task_sql.claim_tasks_psycopg(manual_clock=now is not None)
        params = {**fixed, "claim_owner": self.owner, "lease": self.queue.lease, "limit": limit}
        if now is not None:
            params["now"] = now
        async with (
            self._lane.connection() as conn,
            _commit_window(conn, "claim.before_commit"),
        ):
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(sql, params)
            rows = await cursor.fetchall()
            if rows:
                failpoints.hit("claim.before_commit")
        failpoints.hit("claim.after_commit")
        return claims_from_rows(rows)

    async def close(self) -> None:
        """Close the held connection; claims after this raise RuntimeError."""
        await self._lane.close()


class PsycopgFinishes:
    """Results with their replies in one autocommit statement on a held connection."""

    def __init__(self, queue: TaskQueue, conninfo: str) -> None:
        """The connection opens from `conninfo` at the first batch."""
        self.queue = queue
        self._lane = AsyncLane(conninfo)

    async def finish(self, finished: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Commit results with their replies, as finish_many does; per pair, whether it was.

        A pair not committed was refused; TaskQueue.finish_many, writing it again,
        says why. A database error raises: the statement may or may not have
        committed, as a lost COMMIT answer leaves it.
        """
        refused, completions = task_results.prepare(finished)
        done: set[str] = set()
        if completions:
            replies = task_results.done_reply_rows(completions, self.queue.reply_destination)
            now = clock_value(self.queue.clock)
            params = task_sql.complete_parameters(completions, replies, now)
            async with (
                self._lane.connection() as conn,
                _commit_window(conn, "finish.before_commit"),
            ):
                # Prepared once used a few times, as finish_many's (see task_sql).
                cursor = await conn.execute(task_sql.COMPLETE_POSTGRESQL, params)
                done = {task_id for (task_id,) in await cursor.fetchall()}
                if done:
                    failpoints.hit("finish.before_commit")
        failpoints.hit("finish.after_commit")
        return [
            error is None and claim.task_id in done
            for error, (claim, _) in zip(refused, finished, strict=True)
        ]

    async def close(self) -> None:
        """Close the held connection; batches after this raise RuntimeError."""
        await self._lane.close()


@asynccontextmanager
async def _commit_window(conn: psycopg.AsyncConnection[Any], point: str) -> AsyncIterator[None]:
    """Autocommit as always; while failpoint `point` is armed (a crash test), a transaction,
    so the failpoint the block hits fires before its COMMIT (see one_statement)."""
    if not failpoints.armed(point):
        yield
        return
    async with conn.transaction():
        yield
