"""outbox: index the timestamps the console's charts count per minute

Revision ID: o0010
Revises: o0009
Create Date: 2026-12-03

`outbox console` draws replies enqueued, sent and dead and tasks finished per
minute over the last day. Each count reads only its window, through an index on
the timestamp it counts: created_at of every message; sent_at of sent ones;
available_at (when the last attempt fell due) of dead ones; finished_at of
finished tasks. The partial ones hold only the rows they count. On PostgreSQL
created_at's is a BRIN index: every claim and settle writes a new row version,
and a B-tree over every message would take an entry for each of them; a BRIN
summary of page ranges changes only when a version falls outside its range's
bounds, and messages are written in about created_at order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from alembic import op

revision: str = "o0010"
down_revision: str | None = "o0009"
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
        if where is None:
            options: dict[str, Any] = {"postgresql_using": "brin"}
        else:
            options = {"postgresql_where": sa.text(where), "sqlite_where": sa.text(where)}
        # An operator may have built them beforehand, CONCURRENTLY (docs/reference/schema.md).
        op.create_index(name, table, [column], if_not_exists=True, **options)


def downgrade() -> None:
    for name, table, _, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
