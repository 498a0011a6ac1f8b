"""outbox: an audit of decisions about tasks; the console's lists indexed

Revision ID: o0015
Revises: o0014
Create Date: 2026-12-07

The console cancels a task as `outbox task cancel` does, and each such decision is
kept as a row of its own (who, when, why), as decisions about dead messages are kept in
outbox_requeues. The console lists messages by state, each along the index that holds
that state's rows; resolved messages had none, so the list would read the delivered
history to find them: a partial index of them per destination (on MySQL the dead
messages' (state, destination, id) index serves). Tasks that ended other than done
likewise, by when they finished (on MySQL the (state, deadline) index serves); a done
task never matches its predicate, so finishing one writes no entry there. A new table
and two small indexes: no row is rewritten on any backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import (
    LongText,
    create_partial_index,
    drop_invalid_index,
    drop_partial_index,
    table_options,
)

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
    # An operator may have built them beforehand, CONCURRENTLY (docs/reference/schema.md):
    # each kept when valid.
    drop_invalid_index("ix_outbox_messages_resolved", "outbox_messages")
    drop_invalid_index("ix_outbox_tasks_unsuccessful", "outbox_tasks")
    create_partial_index(
        "ix_outbox_messages_resolved",
        "outbox_messages",
        ["destination", "id"],
        "state = 'resolved'",
        if_not_exists=True,
    )
    create_partial_index(
        "ix_outbox_tasks_unsuccessful",
        "outbox_tasks",
        ["finished_at"],
        "state IN ('failed', 'cancelled', 'expired', 'hop_limit')",
        if_not_exists=True,
    )


def downgrade() -> None:
    drop_partial_index("ix_outbox_tasks_unsuccessful", "outbox_tasks")
    drop_partial_index("ix_outbox_messages_resolved", "outbox_messages")
    op.drop_index(op.f("ix_outbox_task_decisions_task_id"), "outbox_task_decisions")
    op.drop_table("outbox_task_decisions")
