"""outbox: relays announce the destinations they deliver; PostgreSQL and MySQL claim per
destination

Revision ID: o0005
Revises: o0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from outbox.ddl import on_mysql, table_options

revision: str = "o0005"
down_revision: str | None = "o0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "outbox_relays",
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("destination", sa.String(200), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("owner", "destination", name=op.f("pk_outbox_relays")),
        **table_options(),
    )
    op.create_index("ix_outbox_relays_destination", "outbox_relays", ["destination"])
    if op.get_bind().dialect.name == "postgresql":
        # Each relay claims per destination along this index, so pending messages of
        # destinations it does not deliver are never walked.
        op.create_index(
            "ix_outbox_messages_routable",
            "outbox_messages",
            ["destination", "available_at", "id"],
            postgresql_where=sa.text("state = 'pending'"),
        )
    elif on_mysql(op.get_bind()):
        # No partial index: the state leads, and each destination's unkeyed pending
        # messages are one range in claim order, its keys with a pending message one
        # range in key order (outbox.ddl says why state-led). A copy of the name: a migration must
        # not change with the module.
        op.create_index(
            "ix_outbox_messages_state_routable",
            "outbox_messages",
            ["state", "destination", "ordering_key", "available_at", "id"],
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_outbox_messages_routable", table_name="outbox_messages")
    elif on_mysql(op.get_bind()):
        op.drop_index("ix_outbox_messages_state_routable", table_name="outbox_messages")
    op.drop_index("ix_outbox_relays_destination", table_name="outbox_relays")
    op.drop_table("outbox_relays")
