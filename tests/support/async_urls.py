"""The test database through the async drivers outbox.asyncio is tested on."""

from __future__ import annotations

import sqlalchemy as sa

ASYNC_DRIVERS = {
    "sqlite": ("sqlite+aiosqlite",),
    "postgresql": ("postgresql+asyncpg", "postgresql+psycopg"),
    "mysql": ("mysql+asyncmy",),
}
"""Each backend's async drivers, the first the one a single-driver test takes."""
PYMYSQL_ONLY = ("ssl_disabled",)
"""Query keys of the test URLs that only PyMySQL's connect takes (tests/conftest.py)."""


def through(db_url: str, driver: str) -> str:
    """`db_url` through `driver` (a drivername), without PyMySQL's own keys for another
    DBAPI."""
    url = sa.make_url(db_url).set(drivername=driver)
    if not driver.endswith("+pymysql"):
        url = url.difference_update_query(PYMYSQL_ONLY)
    return url.render_as_string(hide_password=False)


def async_urls(db_url: str) -> list[str]:
    """`db_url` through each async driver of its backend."""
    return [
        through(db_url, driver) for driver in ASYNC_DRIVERS[sa.make_url(db_url).get_backend_name()]
    ]


def async_url(db_url: str) -> str:
    """`db_url` through its backend's first async driver."""
    return async_urls(db_url)[0]
