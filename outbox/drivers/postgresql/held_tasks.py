"""The worker's claims and result batches on held psycopg connections of its event loop.

A busy worker claims and commits results many times a second, as coroutines of its
HandlerLoop. Through psycopg they run there too, each stream on a held async
connection (async_lane): the same statements as the driver's claim_tasks (uncapped,
prepared by psycopg once run often) and complete_tasks (planned per run), with no
hop to a thread and back per claim or batch. They connect from the URL of an engine
the toolkit made: a caller's engine, whose settings may live outside its URL
(connect_args, a creator, a token hook), gets none (held_conninfo).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy.engine import Engine

from outbox import failpoints
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.postgresql.async_lane import AsyncLane
from outbox.drivers.postgresql.conninfo import engine_conninfo
from outbox.drivers.postgresql.task_claims import TASK_CLAIM_SESSION, claim_tasks_psycopg
from outbox.drivers.postgresql.task_results import (
    COMPLETE_POSTGRESQL,
    complete_parameters,
    left_parameters,
)
from outbox.drivers.task_interface import Completion


def held_conninfo(engine: Engine, owns_engine: bool) -> str | None:
    """The libpq connection string to hold connections of `engine` with, where they apply:
    an engine the toolkit made from a URL, on psycopg."""
    if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
        return None
    if not owns_engine:
        return None
    return engine_conninfo(engine)


class PsycopgHeldClaims:
    """Claims in one autocommit statement on a held connection set up as the claims'."""

    def __init__(self, pieces: DriverPieces, conninfo: str) -> None:
        """The connection opens from `conninfo` at the first claim."""
        self._pieces = pieces
        self._lane = AsyncLane(conninfo, TASK_CLAIM_SESSION)

    async def claim_tasks(
        self, *, owner: str, now: float | None, lease: float, limit: int, window: str
    ) -> list[dict[str, Any]]:
        """Lease up to `limit` of the best claimable tasks to `owner` in one statement; while
        failpoint `window` is armed, in a transaction it hits before its COMMIT."""
        sql, fixed = claim_tasks_psycopg(self._pieces, manual_clock=now is not None)
        params = {**fixed, "claim_owner": owner, "lease": lease, "limit": limit}
        if now is not None:
            params["now"] = now
        async with self._lane.connection() as conn, commit_window(conn, window):
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(sql, params)
            rows = await cursor.fetchall()
            if rows:
                failpoints.hit(window)
        return rows

    async def close(self) -> None:
        """Close the held connection; claims after this raise RuntimeError."""
        await self._lane.close()


class PsycopgHeldFinishes:
    """Results with their replies in one autocommit statement on a held connection."""

    def __init__(self, conninfo: str) -> None:
        """The connection opens from `conninfo` at the first batch."""
        self._lane = AsyncLane(conninfo)

    async def complete_tasks(
        self,
        completions: Sequence[Completion],
        replies: Sequence[Mapping[str, Any]],
        now: float | None,
        window: str,
    ) -> set[str]:
        """Mark held tasks done and insert the replies of those it changed, in one statement
        and one more for the rows the first left (see COMPLETE_POSTGRESQL); the task_ids
        they changed. A database error raises: the statements may or may not have
        committed, as a lost COMMIT answer leaves it, and the first may have committed
        when the second fails."""
        if not completions:
            return set()
        params = complete_parameters(completions, replies, now)
        async with self._lane.connection() as conn, commit_window(conn, window):
            done = await complete_run(conn, params)
            again = left_parameters(completions, replies, now, done)
            if again is not None:
                done |= await complete_run(conn, again)
            if done:
                failpoints.hit(window)
        return done

    async def close(self) -> None:
        """Close the held connection; batches after this raise RuntimeError."""
        await self._lane.close()


async def complete_run(conn: psycopg.AsyncConnection[Any], params: Mapping[str, Any]) -> set[str]:
    """One run of COMPLETE_POSTGRESQL on `conn`, planned per run as the driver's
    (outbox.drivers.postgresql.task_results); the task_ids it marked done."""
    cursor = await conn.execute(COMPLETE_POSTGRESQL, params, prepare=False)
    return {task_id for (task_id,) in await cursor.fetchall()}


@asynccontextmanager
async def commit_window(conn: psycopg.AsyncConnection[Any], point: str) -> AsyncIterator[None]:
    """Autocommit as always; while failpoint `point` is armed (a crash test), a transaction,
    so the failpoint the block hits fires before its COMMIT (see one_statement)."""
    if not failpoints.armed(point):
        yield
        return
    async with conn.transaction():
        yield
