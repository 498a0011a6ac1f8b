"""What the processes of the example share: names, and settings from the environment.

ORDERS_DB (default postgresql+asyncpg://postgres@127.0.0.1:5432/fastapi_orders) is the
service's database, holding its orders and the outbox; ORDERS_RECEIVER_DB (default:
the same server, database ``<name>_receiver``) is the receiver's, another service's.
None of them starts with OUTBOX_: the outbox commands refuse OUTBOX_* variables they
do not read.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

DB_ENV = "ORDERS_DB"
RECEIVER_DB_ENV = "ORDERS_RECEIVER_DB"
DEFAULT_DB = "postgresql+asyncpg://postgres@127.0.0.1:5432/fastapi_orders"

DESTINATION = "orders"
"""The relay's name for the receiver: order events and task replies both go there."""
SOURCE = "orders-api"
"""The principal the app submits its own tasks as (the queue allows only this one)."""
FULFIL_DEADLINE = 24 * 3600.0
"""Seconds a submitted fulfilment may wait before it expires."""


def database_url() -> str:
    """The service's async database URL (ORDERS_DB)."""
    return os.environ.get(DB_ENV) or DEFAULT_DB


def receiver_database_url() -> str:
    """The receiver's database URL (ORDERS_RECEIVER_DB, else next to the service's)."""
    given = os.environ.get(RECEIVER_DB_ENV)
    if given:
        return given
    service = sa.make_url(database_url())
    return service.set(database=f"{service.database}_receiver").render_as_string(
        hide_password=False
    )
