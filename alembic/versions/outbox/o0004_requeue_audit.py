"""outbox: an audit table for requeued dead replies

Revision ID: o0004
Revises: o0003
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import LongText, table_options

revision: str = "o0004"
down_revision: str | None = "o0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigIdentity = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "outbox_requeues",
        sa.Column("id", BigIdentity, autoincrement=True, nullable=False),
        sa.Column("reply_id", sa.String(200), nullable=False),
        sa.Column("requested_by", sa.String(200), nullable=False),
        sa.Column("reason", LongText, nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("receipt", sa.String(16), nullable=False),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.Column("previous_attempts", sa.Integer(), nullable=False),
        sa.Column("previous_status", sa.Integer(), nullable=True),
        sa.Column("previous_error", LongText, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_requeues")),
        **table_options(),
    )
    op.create_index("ix_outbox_requeues_reply_id", "outbox_requeues", ["reply_id"])


def downgrade() -> None:
    op.drop_index("ix_outbox_requeues_reply_id", table_name="outbox_requeues")
    op.drop_table("outbox_requeues")
