"""The service's own table. A real service has its own migrations; the example creates it."""

from __future__ import annotations

import sqlalchemy as sa

import outbox

metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("item", sa.String(200), nullable=False),
    sa.Column("quantity", sa.Integer, nullable=False),
    sa.Column("status", sa.String(20), nullable=False, server_default="created"),
)


def create_tables(url: str) -> None:
    """Create the orders table when it is missing (the outbox's come from outbox.upgrade)."""
    engine = outbox.create_engine(url)  # the sync driver, for an async URL too
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
