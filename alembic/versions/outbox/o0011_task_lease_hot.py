"""outbox: let a lease renewal be a HOT update

Revision ID: o0011
Revises: o0010
Create Date: 2026-12-02

A Worker's heartbeat renews every lease it holds, and a renewal changes only
lease_until and updated_at. ix_outbox_tasks_lease named lease_until, so each
renewal wrote a new row version with an entry in every running task's index
(four B-tree entries, 761 WAL bytes per renewal measured by
benchmarks/db_cost.py). The reaper of expired leases now walks
ix_outbox_tasks_running_tenant, which holds every running task and no finished
one, and reads lease_until from the rows: as many as leases are held. With no
index on what a renewal changes and 30% of each tasks page left free for the
new version, most renewals are HOT: 233 WAL bytes and 0.4 index entries per
renewal, and one index entry fewer per claim.

Only pages written from now on keep the room; existing rows stay as they are.
SQLite has no fillfactor; it drops the index too, so both backends reap alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from outbox.ddl import create_partial_index, drop_partial_index

revision: str = "o0011"
down_revision: str | None = "o0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FILLFACTOR = 70
LEASE_INDEX = "ix_outbox_tasks_lease"
RUNNING = "state = 'running'"


def upgrade() -> None:
    # An operator may have dropped it beforehand, CONCURRENTLY (docs/reference/schema.md).
    drop_partial_index(LEASE_INDEX, "outbox_tasks", if_exists=True)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE outbox_tasks SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE outbox_tasks RESET (fillfactor)")
    create_partial_index(LEASE_INDEX, "outbox_tasks", ["lease_until"], RUNNING)
