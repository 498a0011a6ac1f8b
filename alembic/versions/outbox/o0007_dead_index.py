"""outbox: index dead messages by destination

Revision ID: o0007
Revises: o0006
Create Date: 2026-12-02

The relay's metrics count dead messages per destination at every scrape. With
no index over dead rows that count read the whole table, delivered history
included; this partial index holds only the dead ones, which are few.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "o0007"
down_revision: str | None = "o0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "ix_outbox_messages_dead"
WHERE = sa.text("state = 'dead'")


def upgrade() -> None:
    op.create_index(
        NAME,
        "outbox_messages",
        ["destination", "id"],
        postgresql_where=WHERE,
        sqlite_where=WHERE,
    )


def downgrade() -> None:
    op.drop_index(NAME, table_name="outbox_messages")
