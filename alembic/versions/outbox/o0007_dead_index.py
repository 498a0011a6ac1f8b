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

from outbox.ddl import create_partial_index, drop_partial_index

revision: str = "o0007"
down_revision: str | None = "o0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "ix_outbox_messages_dead"
WHERE = "state = 'dead'"


def upgrade() -> None:
    create_partial_index(NAME, "outbox_messages", ["destination", "id"], WHERE)


def downgrade() -> None:
    drop_partial_index(NAME, "outbox_messages")
