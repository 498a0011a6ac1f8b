"""outbox: index the timestamps the console's charts count per minute

Revision ID: o0009
Revises: o0008
Create Date: 2026-12-03

`outbox console` draws replies enqueued, sent and dead and tasks finished per
minute over the last day. Each count reads only its window, through an index on
the timestamp it counts: created_at of every message; sent_at of sent ones;
available_at (when the last attempt fell due) of dead ones; finished_at of
finished tasks. The partial ones hold only the rows they count.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "o0009"
down_revision: str | None = "o0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_outbox_messages_created", "outbox_messages", "created_at", None),
    ("ix_outbox_messages_sent", "outbox_messages", "sent_at", "state = 'sent'"),
    ("ix_outbox_messages_died", "outbox_messages", "available_at", "state = 'dead'"),
    ("ix_outbox_tasks_finished", "outbox_tasks", "finished_at", "finished_at IS NOT NULL"),
)


def upgrade() -> None:
    for name, table, column, where in INDEXES:
        partial = {} if where is None else {"postgresql_where": sa.text(where)}
        partial |= {} if where is None else {"sqlite_where": sa.text(where)}
        op.create_index(name, table, [column], **partial)


def downgrade() -> None:
    for name, table, _, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
