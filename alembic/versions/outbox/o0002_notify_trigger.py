"""outbox: NOTIFY relays from a trigger on every insert of outbox messages

Revision ID: o0002
Revises: o0001
Create Date: 2026-11-29

A statement-level trigger wakes listening relays when a transaction that
inserted messages commits, whoever wrote them (publish, task replies, or the
application's own SQL), without a second statement from the writer.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "o0002"
down_revision: str | None = "o0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite relays poll
    op.execute(
        """
        CREATE FUNCTION outbox_notify_messages() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('outbox_messages', '');
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER outbox_messages_notify AFTER INSERT ON outbox_messages "
        "FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_messages()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER outbox_messages_notify ON outbox_messages")
    op.execute("DROP FUNCTION outbox_notify_messages()")
