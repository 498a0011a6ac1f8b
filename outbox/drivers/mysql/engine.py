"""MySQL and MariaDB engines: PyMySQL for `mysql://` and `mariadb://`, READ COMMITTED, a
bounded connect, utf8mb4 on the wire.

The toolkit's own engines run at READ COMMITTED: at REPEATABLE READ, InnoDB's locking
reads take gap and next-key locks, and a claim's `FOR UPDATE SKIP LOCKED` walk then
blocks, or deadlocks with, the inserts of concurrent publishers into the gaps it
walked. An engine the application gives a worker's queue or a relay must be at READ
COMMITTED too (`engine.execution_options(isolation_level="READ COMMITTED")` shares its
pool): they refuse one at another level at start (isolation_refusal). publish() into
the application's own transaction takes no locking read, whatever its level.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from outbox.clients import optional_client
from outbox.drivers.mysql.tenant_lock import release_on_checkin

OWN_DRIVER = "pymysql"
"""The DBAPI of the mysql extra, for a URL that names none."""
ISOLATION = "READ COMMITTED"
CONNECT_TIMEOUT = 10
"""Seconds a connect may take before it fails (PyMySQL's default waits 10 as well, named
here so that every backend's bound is written down)."""
# Async drivers' URLs name the same database: the toolkit's own engines are synchronous.
_ASYNC_DRIVERS = ("aiomysql", "asyncmy")
# The DBAPIs whose connect takes PyMySQL's keyword names.
_PYMYSQL_KEYWORDS = ("pymysql", "mysqldb")


class MySQLEngines:
    """PyMySQL engines (or the DBAPI a URL names) at READ COMMITTED."""

    url_backends: tuple[str, ...] = ("mysql", "mariadb")
    # Several of the driver's methods are two statements where PostgreSQL needs one (a
    # locking pick, then its UPDATE): they need the transaction around them.
    autocommit_statements = False

    def own_url(self, url: sa.URL) -> sa.URL:
        """`url` on PyMySQL when it names no DBAPI or an async one; a sync DBAPI it names
        is kept."""
        backend = url.get_backend_name()
        driver = url.get_driver_name() if "+" in url.drivername else None
        if driver is None or driver in _ASYNC_DRIVERS:
            url = url.set(drivername=f"{backend}+{OWN_DRIVER}")
        return url

    def engine_options(self, url: sa.URL) -> dict[str, Any]:
        """READ COMMITTED, a bounded connect and utf8mb4 unless the URL says otherwise;
        ConfigError naming the extra when the URL's DBAPI is not installed."""
        dbapi = url.get_driver_name()
        if dbapi == OWN_DRIVER:
            optional_client("mysql", "a MySQL or MariaDB database", "pymysql")
        options: dict[str, Any] = {"pool_pre_ping": True, "isolation_level": ISOLATION}
        if dbapi in _PYMYSQL_KEYWORDS:
            connect: dict[str, Any] = {}
            if "connect_timeout" not in url.query:
                connect["connect_timeout"] = CONNECT_TIMEOUT
            if "charset" not in url.query:
                # Four-byte UTF-8 on the wire: the tables' utf8mb4 would otherwise get '?'
                # for characters outside the basic plane from a three-byte connection.
                connect["charset"] = "utf8mb4"
            options["connect_args"] = connect
        return options

    def prepare_engine(self, engine: sa.Engine) -> None:
        """The release of the capped claims' lock when a connection returns to the pool
        (the isolation level is create_engine's option)."""
        release_on_checkin(engine)

    def server_refusal(self, conn: sa.Connection) -> str | None:
        """A binary log in statement format (binlog_refusal), read from the server, or an
        isolation level other than READ COMMITTED on the engine's connections."""
        log_bin, binlog_format, autocommit = conn.execute(
            sa.text("SELECT @@log_bin, @@binlog_format, @@autocommit")
        ).one()
        if autocommit:
            # Each statement its own transaction: a claim's locking pick would release its
            # locks before its UPDATE, and another claim could pick the same rows.
            return (
                "the engine's connections are in autocommit, where a claim's row locks end "
                "with its first statement: pass a URL, or an engine with transactions at "
                'READ COMMITTED (isolation_level="READ COMMITTED")'
            )
        return binlog_refusal(bool(log_bin), str(binlog_format)) or isolation_refusal(
            conn.get_isolation_level()
        )


def isolation_refusal(level: str) -> str | None:
    """Why the claims cannot run at isolation `level`, or None (see the module's docstring)."""
    if level.upper().replace("_", " ") == "READ COMMITTED":
        return None
    return (
        f"the engine's transactions run at {level}, where the claims' locking reads take "
        "gap locks that hold publishers behind them: pass a URL, or the engine as "
        'engine.execution_options(isolation_level="READ COMMITTED")'
    )


def binlog_refusal(log_bin: bool, binlog_format: str) -> str | None:
    """Why a binary log in this format cannot take the claims, or None.

    Which rows `SKIP LOCKED` takes depends on the locks of the moment, so a replica
    replaying the statement would change other rows: statement-based logging refuses it
    (MariaDB error 4175) or logs it unsafely. Row-based and mixed logging (which logs such
    a statement by rows) replay the rows it changed.
    """
    if log_bin and binlog_format.upper() == "STATEMENT":
        return (
            "the server logs statements (binlog_format=STATEMENT), and SKIP LOCKED, which "
            "every claim runs, is unsafe to replay: set binlog_format to ROW or MIXED"
        )
    return None
