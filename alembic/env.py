"""Alembic environment for the outbox and receiver branches.

Used by outbox.upgrade()/receiver.upgrade() (which hand over an open
connection) and by the plain `alembic` command with alembic.ini.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from outbox.db.dialect import create_engine
from outbox.migrations import VERSION_TABLE
from outbox.schema import POSTGRESQL_ONLY_INDEXES
from outbox.schema import metadata as outbox_metadata
from receiver.schema import metadata as receiver_metadata

config = context.config
target_metadata = [outbox_metadata, receiver_metadata]


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Compare only our own tables: a host application's tables are not ours to drop."""
    if type_ == "table":
        return bool(name) and (name.startswith("outbox_") or name.startswith("receiver_"))
    return True


def include_object_on(dialect_name: str) -> Any:
    """include_object, leaving out on other backends the indexes PostgreSQL alone has."""

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "index" and name in POSTGRESQL_ONLY_INDEXES and dialect_name != "postgresql":
            return False
        return include_object(obj, name, type_, reflected, compare_to)

    return include


def run_migrations(connection: Any) -> None:
    """Run the migrations on an open connection."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=config.attributes.get("version_table", VERSION_TABLE),
        render_as_batch=connection.dialect.name == "sqlite",
        include_object=include_object_on(connection.dialect.name),
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "sqlite:///outbox.db")
    with engine.connect() as conn:
        run_migrations(conn)
    engine.dispose()
