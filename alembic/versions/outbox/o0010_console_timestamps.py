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

from alembic import op
from outbox.ddl import create_partial_index, drop_partial_index, on_mysql

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
    mysql = on_mysql(op.get_bind())
    for name, table, column, where in INDEXES:
        # An operator may have built them beforehand, CONCURRENTLY (docs/reference/schema.md);
        # MySQL 8 has no IF NOT EXISTS for an index, and no BRIN: a B-tree.
        if where is not None:
            create_partial_index(name, table, [column], where, if_not_exists=True)
        elif mysql:
            op.create_index(name, table, [column])
        else:
            op.create_index(name, table, [column], if_not_exists=True, postgresql_using="brin")


def downgrade() -> None:
    for name, table, _, where in reversed(INDEXES):
        if where is None:
            op.drop_index(name, table_name=table)
        else:
            drop_partial_index(name, table)
