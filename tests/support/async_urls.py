"""The test database through the async drivers outbox.asyncio is tested on."""

from __future__ import annotations

import sqlalchemy as sa

ASYNC_DRIVERS = {
    "sqlite": ("sqlite+aiosqlite",),
    "postgresql": ("postgresql+asyncpg", "postgresql+psycopg"),
    "mysql": ("mysql+asyncmy",),
}
"""Each backend's async drivers, the first the one a single-driver test takes."""


def async_urls(db_url: str) -> list[str]:
    """`db_url` through each async driver of its backend."""
    url = sa.make_url(db_url)
    return [
        url.set(drivername=driver).render_as_string(hide_password=False)
        for driver in ASYNC_DRIVERS[url.get_backend_name()]
    ]


def async_url(db_url: str) -> str:
    """`db_url` through its backend's first async driver."""
    return async_urls(db_url)[0]
