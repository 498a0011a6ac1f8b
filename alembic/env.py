"""Alembic environment for the outbox and receiver branches.

Used by outbox.upgrade()/receiver.upgrade() (which hand over an open
connection) and by the plain `alembic` command with alembic.ini.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from outbox.alembic_filters import only_ours
from outbox.db.dialect import create_engine
from outbox.migrations import VERSION_TABLE
from outbox.receiver_tables import metadata as receiver_metadata
from outbox.schema import metadata as outbox_metadata

config = context.config
target_metadata = [outbox_metadata, receiver_metadata]


def run_migrations(connection: Any) -> None:
    """Run the migrations on an open connection."""
    # A host application's tables share the database: never reflect or compare them.
    include_name, include_object = only_ours(connection.dialect.name)
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=config.attributes.get("version_table", VERSION_TABLE),
        render_as_batch=connection.dialect.name == "sqlite",
        include_name=include_name,
        include_object=include_object,
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
