"""PostgreSQL engines: psycopg 3 for every URL, a bounded connect, and statements that ask
to be planned per run executed unprepared."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from outbox.drivers.execution import UNPREPARED
from outbox.drivers.postgresql.conninfo import CONNECT_TIMEOUT, bounded

OWN_DRIVER = "postgresql+psycopg"
"""The toolkit's own engines are psycopg 3 whatever driver the URL names (asyncpg,
psycopg2, ...): their SQL binds psycopg's binary arrays and plans some statements
unprepared."""

# asyncpg's URL options that libpq does not know: its TLS switch has a libpq name, its
# statement cache has no meaning for psycopg (which prepares by its own threshold).
# asyncpg's ssl=true verifies the server's certificate and name (a default SSL context).
_ASYNCPG_SSL_MODES = {"true": "verify-full", "false": "disable"}
_ASYNCPG_ONLY_OPTIONS = ("prepared_statement_cache_size", "prepared_statement_name_func")


class PostgreSQLEngines:
    """psycopg 3 engines with a bounded connect and per-run plans where asked."""

    url_backends: tuple[str, ...] = ("postgresql", "postgres")
    autocommit_statements = True

    def own_url(self, url: sa.URL) -> sa.URL:
        """`url` on psycopg 3; an asyncpg URL's options in libpq's names."""
        if url.drivername == "postgresql+asyncpg":
            url = libpq_options(url)
        return url.set(drivername=OWN_DRIVER)

    def engine_options(self, url: sa.URL) -> dict[str, Any]:
        """Pre-ping pooled connections; bound a connect unless the URL or PGCONNECT_TIMEOUT
        already does."""
        options: dict[str, Any] = {"pool_pre_ping": True}
        if "connect_timeout" not in url.query and not bounded(""):
            options["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT}
        return options

    def server_refusal(self, conn: sa.Connection) -> str | None:
        """None: nothing of the server's setting makes its claims unsafe."""
        return None

    def prepare_engine(self, engine: sa.Engine) -> None:
        """Run statements marked UNPREPARED without a prepared plan."""
        if not event.contains(engine, "do_execute", _execute_unprepared):
            event.listen(engine, "do_execute", _execute_unprepared)


def libpq_options(url: sa.URL) -> sa.URL:
    """An asyncpg URL's query with libpq's names: `ssl` is `sslmode`, cache options go."""
    query = dict(url.query)
    for option in _ASYNCPG_ONLY_OPTIONS:
        query.pop(option, None)
    if "ssl" in query:
        ssl = query.pop("ssl")
        if not isinstance(ssl, str):
            raise ValueError("give the ssl option of a database URL once")
        query["sslmode"] = _ASYNCPG_SSL_MODES.get(ssl.lower(), ssl)
    return url.set(query=query)


def _execute_unprepared(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
    # psycopg prepares a statement run five times, and PostgreSQL then may switch to a
    # generic plan: for a join on array parameters it guesses ten elements and can rescan
    # the whole array once per matched row. UNPREPARED statements are planned per run.
    if not context.execution_options.get(UNPREPARED):
        return False
    cursor.execute(statement, parameters, prepare=False)
    return True
