"""How a Worker's event loop claims tasks and commits results: its two lanes.

The claim loop and the batches of results run as coroutines on the worker's
HandlerLoop. On PostgreSQL through psycopg they run there too, on two held
async connections (PsycopgLanes): the same statements as TaskQueue.claim_many
and TaskQueue.finish_many, with the same failpoints around them, and no hop to a
thread and back per claim or batch. They connect from the URL the queue was
opened with: a queue on an engine of the caller's, whose settings may live
outside its URL (connect_args, a creator, a token hook), keeps ThreadedLanes.
Elsewhere (SQLite, other drivers), and for a claim that reconciles first or
counts tenants against their cap (several statements in one transaction), a
claim goes to TaskQueue on a thread of its own, never behind the writer threads
(a write retried through an outage would hold up the claims, and with them the
worker's liveness), and a batch of results on a writer thread (ThreadedLanes).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.rows import dict_row

from outbox import failpoints, task_results
from outbox.claim import Claim, claims_from_rows
from outbox.db import task_sql
from outbox.db.async_lane import AsyncLane
from outbox.db.dialect import clock_value, listen_conninfo
from outbox.handler_loop import HandlerLoop
from outbox.tasks import TaskQueue

DATABASE_ERRORS = (sa.exc.DBAPIError, psycopg.Error)
"""What a lane raises when the database fails or cannot be reached."""


class ThreadedLanes:
    """Claims by TaskQueue on a thread of their own, results on the loop's writer threads."""

    def __init__(self, queue: TaskQueue, loop: HandlerLoop, owner: str) -> None:
        """Claims are leased to `owner` (a name the Worker has checked)."""
        self.queue = queue
        self.owner = owner
        self._loop = loop
        self._claim_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="outbox-claims"
        )

    async def claim(self, limit: int, reconcile: bool) -> list[Claim]:
        """Lease up to `limit` tasks, reconciling first when asked (see claim_many)."""
        claim = partial(self.queue.claim_many, self.owner, limit, reconcile=reconcile)
        return await self._loop.loop.run_in_executor(self._claim_thread, claim)

    async def finish(self, finished: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Commit results with their replies in one transaction; per pair, whether it was.

        A pair not committed was refused (its lease lost, the result not storable):
        TaskQueue.finish_many says why. A database error raises and commits none.
        """
        refused = await self._loop.write(partial(self.queue.finish_many, finished))
        return [error is None for error in refused]

    async def close(self) -> None:
        """End the claim thread (a claim running on it ends first); the queue's own
        connections stay the queue's."""
        self._claim_thread.shutdown(wait=False)


class PsycopgLanes(ThreadedLanes):
    """Claims and results on two held psycopg AsyncConnections of the loop (PostgreSQL)."""

    def __init__(self, queue: TaskQueue, loop: HandlerLoop, owner: str, conninfo: str) -> None:
        """Connections open from `conninfo` at the first statement of each lane."""
        super().__init__(queue, loop, owner)
        self._claims = AsyncLane(conninfo)
        self._finishes = AsyncLane(conninfo)

    async def claim(self, limit: int, reconcile: bool) -> list[Claim]:
        """Lease up to `limit` tasks in one autocommit statement, as claim_many does."""
        if not self.queue.claim_is_one_statement(reconcile):
            return await super().claim(limit, reconcile)
        now = clock_value(self.queue.clock)
        sql, fixed = task_sql.claim_tasks_psycopg(manual_clock=now is not None)
        params = {**fixed, "claim_owner": self.owner, "lease": self.queue.lease, "limit": limit}
        if now is not None:
            params["now"] = now
        async with (
            self._claims.connection() as conn,
            _commit_window(conn, "claim.before_commit"),
        ):
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(sql, params)
            rows = await cursor.fetchall()
            if rows:
                failpoints.hit("claim.before_commit")
        failpoints.hit("claim.after_commit")
        return claims_from_rows(rows)

    async def finish(self, finished: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Commit results with their replies in one autocommit statement, as finish_many does.

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
                self._finishes.connection() as conn,
                _commit_window(conn, "finish.before_commit"),
            ):
                # Planned per run, as finish_many's (see outbox.db.dialect.UNPREPARED).
                cursor = await conn.execute(task_sql.COMPLETE_POSTGRESQL, params, prepare=False)
                done = {task_id for (task_id,) in await cursor.fetchall()}
                if done:
                    failpoints.hit("finish.before_commit")
        failpoints.hit("finish.after_commit")
        return [
            error is None and claim.task_id in done
            for error, (claim, _) in zip(refused, finished, strict=True)
        ]

    async def close(self) -> None:
        """Close both held connections and the claim thread."""
        await super().close()
        await self._claims.close()
        await self._finishes.close()


@asynccontextmanager
async def _commit_window(conn: psycopg.AsyncConnection[Any], point: str) -> AsyncIterator[None]:
    """Autocommit as always; while failpoint `point` is armed (a crash test), a transaction,
    so the failpoint the block hits fires before its COMMIT (see one_statement)."""
    if not failpoints.armed(point):
        yield
        return
    async with conn.transaction():
        yield


def worker_lanes(queue: TaskQueue, loop: HandlerLoop, owner: str) -> ThreadedLanes:
    """The lanes for a Worker of `queue` on `loop`: PsycopgLanes where they apply."""
    engine = queue.engine
    conninfo = listen_conninfo(engine)
    if conninfo is not None and engine.dialect.driver == "psycopg" and queue.owns_engine:
        return PsycopgLanes(queue, loop, owner, conninfo)
    return ThreadedLanes(queue, loop, owner)
