"""outbox: PostgreSQL claims unkeyed messages along an index of their own

Revision ID: o0012
Revises: o0011
Create Date: 2026-12-06

A PostgreSQL claim walked each destination's pending messages in claim order
(ix_outbox_messages_routable) and kept a keyed one only when no earlier message
of its key was pending or sending. Behind a backlog of long keys it walked every
pending message blocked behind its key at each claim (100-180 ms at 20,000
keyed messages). Claims now walk unkeyed messages along this index, which holds
no keyed one, and find each key's first undelivered message along
ix_outbox_messages_ordering, one probe per key. ix_outbox_messages_routable
stays: relays of earlier versions, still running while the database is upgraded
before them, claim along it (a later revision drops it). SQLite claims as it did:
nothing changes there.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "o0012"
down_revision: str | None = "o0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNKEYED = "ix_outbox_messages_unkeyed"
COLUMNS = ["destination", "available_at", "id"]


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    # An operator may have built it beforehand, CONCURRENTLY (docs/reference/schema.md):
    # kept when valid; a build that failed half way leaves an invalid index, which no
    # claim can use and which would otherwise be kept for good.
    valid = bind.execute(
        sa.text(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = :name AND c.relnamespace = to_regnamespace(current_schema())"
        ),
        {"name": UNKEYED},
    ).scalar_one_or_none()
    if valid is False:
        op.drop_index(UNKEYED, table_name="outbox_messages")
    op.create_index(
        UNKEYED,
        "outbox_messages",
        COLUMNS,
        # Pending and unkeyed, as outbox.schema.UNKEYED_PENDING says why (a migration keeps
        # its own copy: it must not change with the module).
        postgresql_where=sa.text("(CASE WHEN ordering_key IS NULL THEN state END) = 'pending'"),
        if_not_exists=True,
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_index(UNKEYED, table_name="outbox_messages")
