"""outbox: leave room on outbox_messages pages for a message's claim and settle

Revision ID: o0009
Revises: o0008
Create Date: 2026-12-03

A message's claim and its settle each change `state`, which the partial
indexes' predicates name, so neither can be a HOT update: each writes a new
row version. On a full page that version goes to another page, and the WAL
then holds a lock record for the old row and the whole new row, body
included; on the same page it holds only the bytes that changed. With 30% of
each page left free, about half of these updates stay on their page: WAL per
delivered message drops from about 1,230 to 955 bytes (-22%, full-page images
aside; more with larger bodies), measured by benchmarks/db_cost.py. The index
entries written are the same. A pending backlog takes more heap (410 bytes a
message instead of 283); once drained, less (820 instead of 895, dead versions
included), the new versions having filled the room instead of new pages.

Only pages written from now on keep the room; existing rows stay as they are.
SQLite has no fillfactor.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "o0009"
down_revision: str | None = "o0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FILLFACTOR = 70


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"ALTER TABLE outbox_messages SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE outbox_messages RESET (fillfactor)")
