"""A database handle: an engine on a current schema and its driver, disposed by whoever
created it.

TaskQueue, Relay and ReceiptStore all open a URL or adopt a caller's engine,
refuse an older schema, and release only the pool they created themselves.
"""

from __future__ import annotations

from typing import Any, Self

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox.drivers import Driver, driver_for
from outbox.errors import ConfigError
from outbox.migrations import OUTBOX_BRANCH, engine_for, ensure_current


class DatabaseHandle:
    """Base of the objects that hold an engine; a context manager that closes it."""

    _engine: Engine
    _owns_engine: bool = False
    _claims_rows: bool = False
    """Whether this object claims rows (SKIP LOCKED): it then checks that the server can."""
    _server_checked: bool = False
    _dialect: str
    _driver: Driver

    def _open(
        self, url_or_engine: str | sa.URL | Engine, branch: str = OUTBOX_BRANCH, **options: Any
    ) -> None:
        """Open the engine and check `branch` is current; on failure release what was opened."""
        self._engine, self._owns_engine = engine_for(url_or_engine, **options)
        try:
            self._check_schema(branch)
            self._driver = driver_for(self._engine)
            if self._claims_rows:
                self._check_server()
        except BaseException:
            self.close()
            raise
        self._dialect = self._engine.dialect.name

    def _check_schema(self, branch: str) -> None:
        ensure_current(self._engine, branch)

    def _check_server(self) -> None:
        """ConfigError when the server's setting makes the claims unsafe (the driver says)."""
        if self._server_checked:
            return
        with self._engine.connect() as conn:
            refusal = self._driver.server_refusal(conn)
        if refusal is not None:
            url = self._engine.url.render_as_string(hide_password=True)
            raise ConfigError(f"database {url}: {refusal}")
        self._server_checked = True

    @property
    def engine(self) -> Engine:
        """The engine this object runs on."""
        return self._engine

    @property
    def driver(self) -> Driver:
        """The database driver of the engine's backend (outbox.drivers)."""
        return self._driver

    @property
    def owns_engine(self) -> bool:
        """Whether this object made its engine from a URL: its connection settings are the URL's."""
        return self._owns_engine

    def ping(self) -> bool:
        """One round trip to the database (raises when it does not answer); for readiness."""
        with self._engine.connect() as conn:
            conn.execute(sa.select(sa.literal(1))).one()
        return True

    def close(self) -> None:
        """Release the connection pool when this object created it."""
        if self._owns_engine:
            self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
