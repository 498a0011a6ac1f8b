"""outbox: relays keep their last answers per destination; workers announce themselves

Revision ID: o0014
Revises: o0013
Create Date: 2026-12-06

The console's overview opens with each destination's health and the live relays and
workers. A relay's announcement row (one per destination it delivers) gains when it
was last made and the relay's last answers from that destination: its last accepted
delivery, and its last failed attempt with status and error. Workers announce
themselves in a table of their own, as relays do. Nullable columns and a new table:
no row is rewritten on any backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import LongText, table_options

revision: str = "o0014"
down_revision: str | None = "o0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("outbox_relays", sa.Column("announced_at", sa.Double()))
    op.add_column("outbox_relays", sa.Column("last_sent_at", sa.Double()))
    op.add_column("outbox_relays", sa.Column("last_failed_at", sa.Double()))
    op.add_column("outbox_relays", sa.Column("last_status", sa.Integer()))
    op.add_column("outbox_relays", sa.Column("last_error", LongText))
    op.create_table(
        "outbox_workers",
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("handler", sa.String(200), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("announced_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_outbox_workers")),
        **table_options(),
    )


def downgrade() -> None:
    op.drop_table("outbox_workers")
    with op.batch_alter_table("outbox_relays") as batch:
        batch.drop_column("last_error")
        batch.drop_column("last_status")
        batch.drop_column("last_failed_at")
        batch.drop_column("last_sent_at")
        batch.drop_column("announced_at")
