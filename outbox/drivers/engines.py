"""The engines family of the driver interface: what a backend's engines need before any
statement runs.

The toolkit's own engines (commands, TaskQueue, Relay, ReceiptStore, migrations) are
synchronous and run the driver's own DBAPI whatever driver an application's URL names
(an AsyncSession's asyncpg or aiosqlite URL names the same database): `own_url` says
which. `engine_options` are create_engine's defaults for the backend; `prepare_engine`
installs the backend's per-connection discipline on an engine, idempotently, also on an
engine the application made.
"""

from __future__ import annotations

from typing import Any, Protocol

import sqlalchemy as sa


class EngineDriver(Protocol):
    """A backend's URLs and engine set-up."""

    url_backends: tuple[str, ...]
    """The backend names of the URLs this driver runs on (a URL's scheme before any `+`)."""
    autocommit_statements: bool
    """Whether work whose statements are each atomic alone runs them in autocommit,
    saving BEGIN and COMMIT round trips (outbox.db.dialect.one_statement); SQLite's
    connections always begin their transaction, IMMEDIATE, to take the write lock first."""

    def own_url(self, url: sa.URL) -> sa.URL:
        """`url` with the DBAPI the toolkit's own engines use on this backend."""
        ...

    def engine_options(self, url: sa.URL) -> dict[str, Any]:
        """create_engine's defaults for `url`; ValueError for a database the toolkit cannot
        share between its connections."""
        ...

    def prepare_engine(self, engine: sa.Engine) -> None:
        """Install the backend's connection discipline on `engine`, once."""
        ...

    def server_refusal(self, conn: sa.Connection) -> str | None:
        """Why the server `conn` is on cannot run the toolkit's claims safely, or None."""
        ...
