"""libpq connection strings: a connect is always bounded in time."""

from __future__ import annotations

import os

import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict, make_conninfo

CONNECT_TIMEOUT = 5
"""Seconds libpq may take to open a PostgreSQL connection. Unbounded, a connect to an
unreachable server waits out the system's TCP retries (minutes), and so does a stop or a
health check waiting behind it. A URL's own `connect_timeout` wins."""


def bounded(conninfo: str) -> bool:
    """Whether the connection string or PGCONNECT_TIMEOUT already bounds a connect."""
    return "PGCONNECT_TIMEOUT" in os.environ or "connect_timeout" in conninfo_to_dict(conninfo)


def bounded_conninfo(conninfo: str) -> str:
    """`conninfo` with connect_timeout CONNECT_TIMEOUT, unless a bound is already given."""
    if bounded(conninfo):
        return conninfo
    return make_conninfo(conninfo, connect_timeout=CONNECT_TIMEOUT)


def engine_conninfo(engine: sa.Engine) -> str:
    """The libpq connection string of a PostgreSQL engine's URL, whatever its driver."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
