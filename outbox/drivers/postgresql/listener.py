"""NOTIFY wake-ups (PostgreSQL): one LISTEN connection kept up on an event loop.

A migration's triggers notify a channel when work arrives: `outbox_tasks` for the
worker's claims, `outbox_messages` for the relay's. Notifications are not durable,
so whoever listens also polls; a Listener only makes an idle process look sooner.
It connects (bounded by CONNECT_TIMEOUT), LISTENs, sets `listening` while it is
connected, and after a failed connection attempt waits `retry` seconds before the
next (a lost connection is replaced at once).

What a notification does is the listener's parameter. With `on_notify`, every
notification is read as it arrives and calls it, and so does each (re)connection,
for what was sent while nobody listened: the worker wakes its producer so. Without
it, notifications are read only when asked: `clear` discards those received so
far (just before a claim, which sees their rows anyway) and `wait` returns at the
next one. A busy relay then pays nothing per committing transaction that adds a
message, only one read per turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox.drivers.postgresql.conninfo import bounded_conninfo, engine_conninfo

_log = logging.getLogger("outbox.drivers.postgresql.listener")


class Listener:
    """A LISTEN connection on `channel`, kept up by keep_listening() until it is cancelled."""

    def __init__(
        self,
        conninfo: str,
        channel: str,
        retry: float,
        listening: threading.Event,
        on_notify: Callable[[], None] | None = None,
        logger: logging.Logger = _log,
    ) -> None:
        """`retry`: the pause after a failed connection attempt; `listening`: set while
        connected; `on_notify`: called per notification and per (re)connection, if given."""
        self._conninfo = conninfo
        self._channel = channel
        self._retry = retry
        self.listening = listening
        self._on_notify = on_notify
        self._log = logger
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._up = asyncio.Event()
        self._lost = asyncio.Event()

    async def keep_listening(self) -> None:
        """Connect and LISTEN, and again after each loss; runs until cancelled."""
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    bounded_conninfo(self._conninfo), autocommit=True
                )
                try:
                    await conn.execute(f"LISTEN {self._channel}")
                except BaseException:
                    # Lost before it listened, or a stop came meanwhile: the connection
                    # is closed here, since nothing below will close it.
                    await conn.close()
                    raise
            except psycopg.Error as exc:
                self._log.warning("LISTEN connection failed (%s); polling until it is back", exc)
                await asyncio.sleep(self._retry)
                continue
            self._conn = conn
            self._up.set()
            self.listening.set()
            try:
                if self._on_notify is None:
                    await self._lost.wait()
                else:
                    self._on_notify()  # what was sent while nobody listened
                    await self._forward(conn, self._on_notify)
            finally:
                self._down()
                await conn.close()

    async def clear(self) -> None:
        """Discard the notifications received so far (call just before a claim)."""
        if self._conn is not None:
            await self._read(self._conn, 0, None)

    async def wait(self, timeout: float) -> None:
        """Return at the first notification since `clear`, or after `timeout` seconds.

        Also returns early when the connection is lost or comes back: notifications
        sent meanwhile were missed, so the caller should claim and see for itself.
        """
        if self._conn is not None:
            await self._read(self._conn, timeout, 1)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout)

    async def _forward(self, conn: psycopg.AsyncConnection[Any], call: Callable[[], None]) -> None:
        """Call `call` per notification until the connection fails."""
        try:
            async for _ in conn.notifies():
                call()
        except psycopg.Error as exc:
            self._log.warning("LISTEN connection lost (%s); polling until it is back", exc)

    async def _read(
        self, conn: psycopg.AsyncConnection[Any], timeout: float, stop_after: int | None
    ) -> None:
        try:
            async for _ in conn.notifies(timeout=timeout, stop_after=stop_after):
                pass
        except psycopg.Error as exc:
            if conn is self._conn:
                self._log.warning("LISTEN connection lost (%s); polling until it is back", exc)
                self._lost.set()

    def _down(self) -> None:
        self._lost.clear()
        self._up.clear()
        self.listening.clear()
        self._conn = None


def listener(
    engine: sa.Engine,
    channel: str,
    retry: float,
    listening: threading.Event,
    on_notify: Callable[[], None] | None = None,
    logger: logging.Logger | None = None,
) -> Listener:
    """A Listener on `channel` of a PostgreSQL engine's database."""
    return Listener(engine_conninfo(engine), channel, retry, listening, on_notify, logger or _log)
