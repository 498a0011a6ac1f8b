"""A lane: one autocommit connection held for a stream of single statements.

A worker claims and finishes many times a second, each time one statement in
autocommit. Checking a connection out of the pool for each costs the checkout's
CPU and, with pre-ping on, a round trip before the statement. A lane holds one
connection instead: the first caller at a time uses it, and a caller that finds
it in use takes a pooled connection as before, so callers never wait for each
other. A connection idle for longer than IDLE_SECONDS goes back to the pool when
the next statement comes, which takes a checked one: an idle worker's first
statement does not meet a connection a proxy or firewall has cut meanwhile. After
any error the held connection is dropped: its state is unknown. Once closed, a
lane holds nothing: every statement takes a pooled connection.

A lane may run a `setup` statement (a session setting) on each connection it
takes to hold. It closes such a connection when it lets it go: undoing the setting
would be a round trip on a connection it distrusts (idle, or after an error), and
RESET would not restore a value the application's own pool events had set. One
that reaches the pool some other way (a lane never closed, a caller closing the
lane's connection) is discarded at its next checkout, so the setting never reaches
another caller. A pooled connection standing in for the held one (busy, or the lane
closed) gets the setting too, since the statements rely on it (the task claim's plan
does), and is discarded after that one use: a stand-in is rare, a reconnect cheaper
than a wrong plan.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine

IDLE_SECONDS = 5.0
_SET = "outbox.lane_setup"
"""Key in a pooled connection's info once a lane's setup has run on it."""


def _refuse_set_connection(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    # Pool checkout: a connection still under a lane's setting is discarded, not lent.
    if record.info.get(_SET):
        raise exc.DisconnectionError("a lane's session setting is still applied")


class Lane:
    """One held autocommit connection of `engine`, for one caller at a time."""

    def __init__(self, engine: Engine, setup: str | None = None) -> None:
        """Nothing connects until the first statement; `setup` runs on each held connection."""
        self._engine = engine
        self._setup = setup
        if setup is not None and not event.contains(
            engine.pool, "checkout", _refuse_set_connection
        ):
            event.listen(engine.pool, "checkout", _refuse_set_connection)
        self._lock = threading.Lock()
        self._held: Connection | None = None
        self._last_used = 0.0
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """The held connection when it is free, else a pooled one; autocommit either way."""
        if not self._lock.acquire(blocking=False):
            with self._stand_in() as pooled:
                yield pooled
            return
        try:
            if self._closed:
                with self._stand_in() as pooled:
                    yield pooled
                return
            held = self._take()
            try:
                yield held
            except BaseException:
                self._drop()
                raise
            self._last_used = time.monotonic()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Let the held connection go (waits for a statement running on it); statements
        after this take pooled connections."""
        self._closed = True
        with self._lock:
            self._drop()

    @contextmanager
    def _stand_in(self) -> Iterator[Connection]:
        """A pooled connection for one caller, with the setup when there is one; such a
        connection is discarded afterwards, never given back with the setting."""
        with self._engine.connect() as pooled:
            if self._setup is None:
                yield pooled
                return
            try:
                pooled.connection.info[_SET] = True  # first: a failed setup is discarded too
                pooled.exec_driver_sql(self._setup)
                yield pooled
            finally:
                with contextlib.suppress(Exception):
                    pooled.invalidate()

    def _take(self) -> Connection:
        held = self._held
        if held is not None and (
            held.closed or held.invalidated or time.monotonic() - self._last_used > IDLE_SECONDS
        ):
            self._drop()
            held = None
        if held is None:
            held = self._engine.connect()
            if self._setup is not None:
                try:
                    held.connection.info[_SET] = True  # first: a failed setup is discarded too
                    held.exec_driver_sql(self._setup)
                except BaseException:
                    with contextlib.suppress(Exception):
                        held.close()
                    raise
            self._held = held
        return held

    def _drop(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        # Dropped for an error, for idling or at close: a broken one may fail to close too.
        with contextlib.suppress(Exception):
            if self._setup is not None:
                held.invalidate()  # closed now, not given back to the pool with the setting
            held.close()
