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

A lane may hold its connections under a SessionSetting: applied on each
connection it takes to hold, undone before it lets one go (closed instead when
the undo fails). A connection that reaches the pool still set (a lane dropped
without close, a caller closing the lane's connection) is discarded at its next
checkout, so the setting never reaches another caller.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine

IDLE_SECONDS = 5.0
_SET = "outbox.lane_setting"
"""Key in a pooled connection's info while a lane's session setting is applied to it."""


class SessionSetting(NamedTuple):
    """A session setting a lane holds its connections under: SQL to apply it, to undo it."""

    apply: str
    undo: str


def _refuse_set_connection(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    # Pool checkout: a connection still under a lane's setting is discarded, not lent.
    if record.info.get(_SET):
        raise exc.DisconnectionError("a lane's session setting is still applied")


class Lane:
    """One held autocommit connection of `engine`, for one caller at a time."""

    def __init__(self, engine: Engine, setting: SessionSetting | None = None) -> None:
        """Nothing connects until the first statement; held connections get `setting`."""
        self._engine = engine
        self._setting = setting
        if setting is not None and not event.contains(
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
        """Let the held connection go (waits for a statement running on it); statements
        after this take pooled connections."""
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
            held = self._engine.connect()
            if self._setting is not None:
                try:
                    held.connection.info[_SET] = True  # before: a failed apply is discarded
                    held.exec_driver_sql(self._setting.apply)
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
            if self._setting is not None and not (held.closed or held.invalidated):
                held.exec_driver_sql(self._setting.undo)
                held.connection.info.pop(_SET, None)
        with contextlib.suppress(Exception):
            held.close()  # still marked when the undo failed: discarded at its next checkout
