"""receiver: receipts and reference effects

Revision ID: r0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import LongBinary, table_options

revision: str = "r0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("receiver",)
depends_on: str | Sequence[str] | None = None

BigIdentity = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "receiver_receipts",
        sa.Column("reply_id", sa.String(200), nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("body", LongBinary, nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("reply_id", name=op.f("pk_receiver_receipts")),
        **table_options(),
    )
    op.create_index("ix_receiver_receipts_received_at", "receiver_receipts", ["received_at"])
    op.create_table(
        "receiver_effects",
        sa.Column("id", BigIdentity, autoincrement=True, nullable=False),
        sa.Column("reply_id", sa.String(200), nullable=False),
        sa.Column("body", LongBinary, nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_receiver_effects")),
        **table_options(),
    )
    op.create_index(op.f("ix_receiver_effects_reply_id"), "receiver_effects", ["reply_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_receiver_effects_reply_id"), table_name="receiver_effects")
    op.drop_table("receiver_effects")
    op.drop_index("ix_receiver_receipts_received_at", table_name="receiver_receipts")
    op.drop_table("receiver_receipts")
