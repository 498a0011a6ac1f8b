"""outbox: each failed delivery attempt kept, for a reply's timeline

Revision ID: o0016
Revises: o0015
Create Date: 2026-12-07

A message kept only its last outcome: the console's timeline of a reply could not say
which attempts failed, when, and why. Each attempt that does not end in a delivery (a
retry, a death, a lease that expired mid-send) is now a row of its own, written in the
transaction that records the outcome; a delivery accepted writes nothing more, so the
drain's path is unchanged. A new table: no row is rewritten on any backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import LongText, table_options

revision: str = "o0016"
down_revision: str | None = "o0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bigint = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "outbox_failed_attempts",
        sa.Column("id", bigint, autoincrement=True, nullable=False),
        sa.Column("message_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("status", sa.Integer()),
        sa.Column("error", LongText),
        sa.Column("attempted_at", sa.Double(), nullable=False),
        sa.CheckConstraint(
            "state IN ('pending', 'dead')", name=op.f("ck_outbox_failed_attempts_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_failed_attempts")),
        **table_options(),
    )
    op.create_index(
        op.f("ix_outbox_failed_attempts_message_id"),
        "outbox_failed_attempts",
        ["message_id", "id"],
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_outbox_failed_attempts_message_id"), "outbox_failed_attempts")
    op.drop_table("outbox_failed_attempts")
