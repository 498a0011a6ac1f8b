"""outbox: each destination's backlog sampled once a minute, for the console's chart

Revision ID: o0017
Revises: o0016
Create Date: 2026-12-07

How old the oldest undelivered message of a destination was an hour ago cannot be read
from the messages afterwards at any reasonable cost. Relays now sample it once a minute,
with the backlog, one row per minute and destination (the first relay to sample a
minute writes it), kept two days. A new table: no row is rewritten on any backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import table_options

revision: str = "o0017"
down_revision: str | None = "o0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "outbox_backlog_samples",
        sa.Column("sampled_at", sa.Double(), nullable=False),
        sa.Column("destination", sa.String(200), nullable=False),
        sa.Column("backlog", sa.Integer(), nullable=False),
        sa.Column("oldest_age", sa.Double()),
        sa.PrimaryKeyConstraint(
            "sampled_at", "destination", name=op.f("pk_outbox_backlog_samples")
        ),
        **table_options(),
    )


def downgrade() -> None:
    op.drop_table("outbox_backlog_samples")
