"""outbox: inbox, tasks and outbox messages

Revision ID: o0001
Revises:
Create Date: 2026-11-29

On MySQL and MariaDB the tables are InnoDB in utf8mb4 with a binary NO PAD collation
(identifiers compared byte for byte), bodies LONGBLOB and payloads LONGTEXT, and each
partial index whose predicate names a state is built as its InnoDB counterpart, a full
index leading with `state`, so that a claim walks exactly the pending range in claim
order and stops at its LIMIT however much history the table holds (outbox.ddl says
each one and why).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import LongBinary, LongText, create_partial_index, table_options

revision: str = "o0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("outbox",)
depends_on: str | Sequence[str] | None = None

BigIdentity = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TASK_STATES = (
    "state IN ('pending', 'running', 'done', 'failed', 'cancelled', 'expired', 'hop_limit')"
)
MESSAGE_STATES = "state IN ('pending', 'sending', 'sent', 'dead')"


def upgrade() -> None:
    op.create_table(
        "outbox_inbox",
        sa.Column("principal", sa.String(200), nullable=False),
        sa.Column("message_id", sa.String(128), nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("content", LongText, nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("principal", "message_id", name=op.f("pk_outbox_inbox")),
        sa.UniqueConstraint("task_id", name=op.f("uq_outbox_inbox_task_id")),
        **table_options(),
    )
    op.create_table(
        "outbox_tasks",
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(200), nullable=False),
        sa.Column("payload", LongText, nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("deadline", sa.Double(), nullable=False),
        sa.Column("hops", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("available_at", sa.Double(), nullable=False),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("lease_until", sa.Double(), nullable=True),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("result", LongText, nullable=True),
        sa.Column("last_error", LongText, nullable=True),
        sa.Column("cancel_requested_at", sa.Double(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.CheckConstraint(TASK_STATES, name=op.f("ck_outbox_tasks_state")),
        sa.CheckConstraint(
            "attempts >= 0 AND attempts <= max_attempts", name=op.f("ck_outbox_tasks_attempts")
        ),
        sa.PrimaryKeyConstraint("task_id", name=op.f("pk_outbox_tasks")),
        **table_options(),
    )
    create_partial_index(
        "ix_outbox_tasks_claimable",
        "outbox_tasks",
        ["priority DESC", "available_at", "created_at"],
        "state = 'pending'",
    )
    create_partial_index(
        "ix_outbox_tasks_lease", "outbox_tasks", ["lease_until"], "state = 'running'"
    )
    create_partial_index(
        "ix_outbox_tasks_running_tenant", "outbox_tasks", ["tenant_id"], "state = 'running'"
    )
    create_partial_index(
        "ix_outbox_tasks_deadline", "outbox_tasks", ["deadline"], "state IN ('pending', 'running')"
    )
    op.create_table(
        "outbox_messages",
        sa.Column("id", BigIdentity, autoincrement=True, nullable=False),
        sa.Column("reply_id", sa.String(200), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=True),
        sa.Column("destination", sa.String(200), nullable=False),
        sa.Column("ordering_key", sa.String(200), nullable=True),
        sa.Column("body", LongBinary, nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("headers", LongText, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("available_at", sa.Double(), nullable=False),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("lease_until", sa.Double(), nullable=True),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("last_error", LongText, nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("sent_at", sa.Double(), nullable=True),
        sa.CheckConstraint(MESSAGE_STATES, name=op.f("ck_outbox_messages_state")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_messages")),
        sa.UniqueConstraint("reply_id", name=op.f("uq_outbox_messages_reply_id")),
        sa.UniqueConstraint("task_id", name=op.f("uq_outbox_messages_task_id")),
        **table_options(),
    )
    create_partial_index(
        "ix_outbox_messages_deliverable",
        "outbox_messages",
        ["available_at", "id"],
        "state = 'pending'",
    )
    create_partial_index(
        "ix_outbox_messages_lease", "outbox_messages", ["lease_until"], "state = 'sending'"
    )
    create_partial_index(
        "ix_outbox_messages_ordering",
        "outbox_messages",
        ["destination", "ordering_key", "id"],
        "state IN ('pending', 'sending') AND ordering_key IS NOT NULL",
    )


def downgrade() -> None:
    op.drop_table("outbox_messages")
    op.drop_table("outbox_tasks")
    op.drop_table("outbox_inbox")
