"""NOTIFY wake-ups for the worker's claim loop (PostgreSQL): a listening thread.

Migration o0008 notifies the channel `outbox_tasks` when a transaction that
inserted tasks (or returned one to `pending`, due at once) commits. The thread
turns each notification into a call of `wake`, so an idle worker claims a new
task at once instead of at its next poll. Notifications are not durable: the
worker still polls, and after a reconnection it looks once, for what it missed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg

from outbox.db.dialect import TASKS_NOTIFY_CHANNEL
from outbox.drivers.postgresql.conninfo import CONNECT_TIMEOUT, bounded_conninfo

log = logging.getLogger("outbox.worker")
# How often the thread looks up from its connection to see whether it should end.
CHECK_EVERY = 0.5


class TaskWakeups:
    """A LISTEN connection on a daemon thread, kept up until close()."""

    def __init__(
        self,
        conninfo: str,
        wake: Callable[[], None],
        retry: float,
        listening: threading.Event,
    ) -> None:
        """`wake` is called per notification; `retry` is the pause between reconnections;
        `listening` is set while connected."""
        self._conninfo = conninfo
        self._wake = wake
        self._retry = retry
        self._closed = threading.Event()
        self.listening = listening
        self._thread = threading.Thread(target=self._run, name="outbox-listen", daemon=True)

    def start(self) -> None:
        """Start listening in the background."""
        self._thread.start()

    def close(self) -> None:
        """Stop listening; returns once the thread has ended (within CONNECT_TIMEOUT)."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(CONNECT_TIMEOUT + CHECK_EVERY)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                with psycopg.connect(bounded_conninfo(self._conninfo), autocommit=True) as conn:
                    conn.execute(f"LISTEN {TASKS_NOTIFY_CHANNEL}")
                    self.listening.set()
                    self._wake()  # what arrived while we were not listening
                    while not self._closed.is_set():
                        for _ in conn.notifies(timeout=CHECK_EVERY):
                            self._wake()
            except psycopg.Error as exc:
                # A lost connection is replaced at once; a failed connect waits first.
                lost = self.listening.is_set()
                self.listening.clear()
                log.warning("LISTEN connection failed (%s); polling until it is back", exc)
                if not lost:
                    self._closed.wait(self._retry)
        self.listening.clear()
