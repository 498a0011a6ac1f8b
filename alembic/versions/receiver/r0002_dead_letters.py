"""receiver: the consumer's dead letters (messages whose effect kept raising)

Revision ID: r0002
Revises: r0001
Create Date: 2026-12-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import LongBinary, LongText, table_options

revision: str = "r0002"
down_revision: str | None = "r0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "receiver_dead_letters",
        sa.Column("reply_id", sa.String(200), nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("body", LongBinary, nullable=False),
        sa.Column("headers", LongText, nullable=False),
        sa.Column("reason", LongText, nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("deliveries", sa.Integer(), nullable=True),
        sa.Column("broker", sa.String(20), nullable=True),
        sa.Column("broker_ref", sa.String(400), nullable=True),
        sa.Column("dead_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("reply_id", name=op.f("pk_receiver_dead_letters")),
        **table_options(),
    )
    op.create_index("ix_receiver_dead_letters_dead_at", "receiver_dead_letters", ["dead_at"])


def downgrade() -> None:
    op.drop_index("ix_receiver_dead_letters_dead_at", table_name="receiver_dead_letters")
    op.drop_table("receiver_dead_letters")
