"""outbox: a task keeps the trace context it was submitted in

Revision ID: o0013
Revises: o0012
Create Date: 2026-12-06

A task received inside an active OpenTelemetry span keeps that span's traceparent and
tracestate, its creation context, for the spans of its runs to link to. Two nullable
columns: adding them rewrites no row on either backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "o0013"
down_revision: str | None = "o0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("outbox_tasks", sa.Column("traceparent", sa.String(55)))
    op.add_column("outbox_tasks", sa.Column("tracestate", sa.String(512)))


def downgrade() -> None:
    with op.batch_alter_table("outbox_tasks") as batch:
        batch.drop_column("tracestate")
        batch.drop_column("traceparent")
