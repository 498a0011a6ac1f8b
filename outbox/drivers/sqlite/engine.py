"""SQLite engines: WAL, synchronous=FULL, a busy timeout, and BEGIN IMMEDIATE.

A transaction that will write takes the write lock up front: a deferred one fails
with "database is locked" when it upgrades under contention. Connections marked
READ_ONLY begin deferred, so they do not wait for the writer.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection

from outbox.drivers.execution import READ_ONLY

BUSY_TIMEOUT_MS = 30_000
"""How long a connection waits for the write lock before "database is locked"."""
_PREPARED = "outbox_prepared"
_IN_MEMORY = (None, "", ":memory:")


class SQLiteEngines:
    """sqlite3 engines on a file, in WAL mode, beginning immediately."""

    url_backends: tuple[str, ...] = ("sqlite",)
    autocommit_statements = False

    def own_url(self, url: sa.URL) -> sa.URL:
        """`url` on sqlite3 (an aiosqlite URL names the same file)."""
        if url.drivername == "sqlite+aiosqlite":
            return url.set(drivername="sqlite")
        return url

    def engine_options(self, url: sa.URL) -> dict[str, Any]:
        """None; refuses an in-memory database."""
        if url.database in _IN_MEMORY:
            raise ValueError(
                "an in-memory SQLite database is private to one connection: use a file"
            )
        return {}

    def server_refusal(self, conn: sa.Connection) -> str | None:
        """None: nothing of the server's setting makes its claims unsafe."""
        return None

    def prepare_engine(self, engine: sa.Engine) -> None:
        """Install the transaction discipline (see the module's docstring)."""
        if not event.contains(engine, "begin", _begin):
            event.listen(engine, "begin", _begin)


def _begin(conn: Connection) -> None:
    dbapi = conn.connection.dbapi_connection
    record = conn.connection
    if not record.info.get(_PREPARED):
        # Let us, not pysqlite, decide when transactions begin.
        dbapi.isolation_level = None  # type: ignore[union-attr]
        cursor = dbapi.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = FULL")
        finally:
            cursor.close()
        record.info[_PREPARED] = True
    read_only = conn.get_execution_options().get(READ_ONLY, False)
    conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
