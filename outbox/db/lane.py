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
takes to hold. Such a connection is closed when the lane lets it go, never given
back to the pool, so the setting stays with the lane's own statements.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import Connection, Engine

IDLE_SECONDS = 5.0


class Lane:
    """One held autocommit connection of `engine`, for one caller at a time."""

    def __init__(self, engine: Engine, setup: str | None = None) -> None:
        """Nothing connects until the first statement; `setup` runs on each held connection."""
        self._engine = engine
        self._setup = setup
        self._lock = threading.Lock()
        self._held: Connection | None = None
        self._last_used = 0.0
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """The held connection when it is free, else a pooled one; autocommit either way."""
        if not self._lock.acquire(blocking=False):
            with self._engine.connect() as pooled:
                yield pooled
            return
        try:
            if self._closed:
                with self._engine.connect() as pooled:
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
        """Give the held connection back to the pool (waits for a statement running on it);
        statements after this take pooled connections."""
        self._closed = True
        with self._lock:
            self._drop()

    def _take(self) -> Connection:
        held = self._held
        if held is not None and (
            held.closed or held.invalidated or time.monotonic() - self._last_used > IDLE_SECONDS
        ):
            self._drop()
            held = None
        if held is None:
            held = self._held = self._engine.connect()
            if self._setup is not None:
                held.exec_driver_sql(self._setup)
        return held

    def _drop(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            # Dropped for an error or for idling: a broken one may fail to close too.
            with contextlib.suppress(Exception):
                if self._setup is not None:
                    held.invalidate()  # its session setting must not reach the pool
                held.close()
