"""outbox: an audit of operators' decisions about tasks

Revision ID: o0015
Revises: o0014
Create Date: 2026-12-07

The console cancels a task as `outbox task cancel` does, and each such decision is
kept as a row of its own (who, when, why), as decisions about dead messages are kept in
outbox_requeues. A new table: no row is rewritten on any backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import LongText, table_options

revision: str = "o0015"
down_revision: str | None = "o0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bigint = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "outbox_task_decisions",
        sa.Column("id", bigint, autoincrement=True, nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("requested_by", sa.String(200), nullable=False),
        sa.Column("reason", LongText, nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.CheckConstraint("action IN ('cancel')", name=op.f("ck_outbox_task_decisions_action")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_task_decisions")),
        **table_options(),
    )
    op.create_index(op.f("ix_outbox_task_decisions_task_id"), "outbox_task_decisions", ["task_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_outbox_task_decisions_task_id"), "outbox_task_decisions")
    op.drop_table("outbox_task_decisions")
