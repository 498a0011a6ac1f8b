"""NOTIFY wake-ups for the relay loop (PostgreSQL), read only while the loop waits.

Every committing transaction that adds a message notifies every listening relay.
Reading each notification as it arrives would wake a busy relay once per such
commit, for nothing: a busy relay claims again as soon as it can anyway. So the
loop reads them at two moments only: it discards what arrived before a claim
(that claim sees those rows), and after a claim that found no backlog it waits
for the next one. Notifications are not durable; the loop also polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import psycopg

from outbox.db.dialect import NOTIFY_CHANNEL
from outbox.drivers.postgresql.conninfo import bounded_conninfo

log = logging.getLogger("outbox.relay")


class Wakeups:
    """A LISTEN connection kept up in the background; `clear` and `wait` for the loop."""

    def __init__(self, conninfo: str, retry: float, listening: threading.Event) -> None:
        """`retry` is the pause between reconnections; `listening` is set while connected."""
        self._conninfo = conninfo
        self._retry = retry
        self.listening = listening
        self._conn: psycopg.AsyncConnection[object] | None = None
        self._up = asyncio.Event()
        self._lost = asyncio.Event()

    async def keep_listening(self) -> None:
        """Connect and LISTEN, and again after each loss; runs until cancelled."""
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    bounded_conninfo(self._conninfo), autocommit=True
                )
                await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            except psycopg.Error as exc:
                log.warning("LISTEN connection failed (%s); polling until it is back", exc)
                await asyncio.sleep(self._retry)
                continue
            self._conn = conn
            self._up.set()
            self.listening.set()
            try:
                await self._lost.wait()
            finally:
                self._lost.clear()
                self._up.clear()
                self.listening.clear()
                self._conn = None
                await conn.close()

    async def clear(self) -> None:
        """Discard the notifications received so far (call just before a claim)."""
        if self._conn is not None:
            await self._read(self._conn, 0, None)

    async def wait(self, timeout: float) -> None:
        """Return at the first notification since `clear`, or after `timeout` seconds.

        Also returns early when the connection is lost or comes back: notifications
        sent meanwhile were missed, so the loop should claim and see for itself.
        """
        if self._conn is not None:
            await self._read(self._conn, timeout, 1)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout)

    async def _read(
        self, conn: psycopg.AsyncConnection[object], timeout: float, stop_after: int | None
    ) -> None:
        try:
            async for _ in conn.notifies(timeout=timeout, stop_after=stop_after):
                pass
        except psycopg.Error as exc:
            if conn is self._conn:
                log.warning("LISTEN connection lost (%s); polling until it is back", exc)
                self._lost.set()
