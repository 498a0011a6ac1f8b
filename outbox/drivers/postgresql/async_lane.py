"""An async lane: one held autocommit psycopg connection on an event loop (PostgreSQL).

The worker's claims and finishes run on its event loop, as coroutines (see
held_tasks): a claim or a batch of results then costs no hop to a thread and back,
which was most of a busy worker's CPU. The rules are those of outbox.db.lane: statements run one
at a time on the held connection; after any error or cancellation it is closed
(its state is unknown) and the next statement opens another; one idle for longer
than IDLE_SECONDS is replaced before the next statement, which then does not
meet a connection a proxy or firewall has cut meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg

from outbox.db.lane import IDLE_SECONDS
from outbox.drivers.postgresql.conninfo import bounded_conninfo


class AsyncLane:
    """One held autocommit AsyncConnection, opened from a libpq connection string."""

    def __init__(self, conninfo: str, setup: str | None = None) -> None:
        """Nothing connects until the first statement; `setup` runs on each connection."""
        self._conninfo = conninfo
        self._setup = setup
        self._held: psycopg.AsyncConnection[Any] | None = None
        self._last_used = 0.0
        self._closed = False

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The held connection (opened when there is none); autocommit."""
        if self._closed:
            raise RuntimeError("the lane is closed")
        held = await self._take()
        try:
            yield held
        except BaseException:
            await self._drop()
            raise
        self._last_used = time.monotonic()

    async def close(self) -> None:
        """Close the held connection; statements after this raise RuntimeError.

        A statement in flight is not waited for: its caller gets an error, while the
        server may still commit it (a worker closes its lanes after its drain, so only
        an abandoned task's guarded write can be in flight then).
        """
        self._closed = True
        await self._drop()

    async def _take(self) -> psycopg.AsyncConnection[Any]:
        held = self._held
        if held is not None and (held.closed or time.monotonic() - self._last_used > IDLE_SECONDS):
            await self._drop()
            held = None
        if held is None:
            held = await psycopg.AsyncConnection.connect(
                bounded_conninfo(self._conninfo), autocommit=True
            )
            if self._setup is not None:
                try:
                    await held.execute(self._setup)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await held.close()
                    raise
            self._held = held
        return held

    async def _drop(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            # Dropped for an error or for idling: a broken one may fail to close too.
            with contextlib.suppress(Exception):
                await held.close()
