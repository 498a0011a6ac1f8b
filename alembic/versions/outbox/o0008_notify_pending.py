"""outbox: NOTIFY workers of new and returned tasks, and relays of requeued messages

Revision ID: o0008
Revises: o0007
Create Date: 2026-12-02

Workers polled for tasks, so a task waited up to a poll interval before its
claim. A statement-level trigger on task inserts notifies the channel
`outbox_tasks` when the transaction commits, whoever inserted them. A row-level
trigger notifies the same channel when a task goes back to `pending` due at
once (a requeue; an expired lease with attempts left), and the channel
`outbox_messages` when a message goes back to `pending` (`outbox dead requeue`),
so relays see requeued rows at once. Their WHEN clauses keep the relay's own
updates (claims, deliveries, retries) free of any trigger call: a retry waits
for its backoff anyway, and a message whose lease expired is taken back by the
relay that reaps it.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "o0008"
down_revision: str | None = "o0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Due at once: a failed attempt waiting out its backoff would wake workers for nothing.
TASK_RETURNS = (
    "WHEN (NEW.state = 'pending' AND OLD.state <> 'pending' AND NEW.available_at <= NEW.updated_at)"
)
MESSAGE_REQUEUED = "WHEN (NEW.state = 'pending' AND OLD.state = 'dead')"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite workers and relays poll
    op.execute(
        """
        CREATE FUNCTION outbox_notify_tasks() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('outbox_tasks', '');
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER outbox_tasks_notify AFTER INSERT ON outbox_tasks "
        "FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_tasks()"
    )
    op.execute(
        "CREATE TRIGGER outbox_tasks_notify_pending AFTER UPDATE OF state ON outbox_tasks "
        f"FOR EACH ROW {TASK_RETURNS} EXECUTE FUNCTION outbox_notify_tasks()"
    )
    # Notifications with the same channel and payload in one transaction are sent
    # once, so a requeue of many rows wakes each relay once.
    op.execute(
        "CREATE TRIGGER outbox_messages_notify_pending AFTER UPDATE OF state ON outbox_messages "
        f"FOR EACH ROW {MESSAGE_REQUEUED} EXECUTE FUNCTION outbox_notify_messages()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER outbox_messages_notify_pending ON outbox_messages")
    op.execute("DROP TRIGGER outbox_tasks_notify_pending ON outbox_tasks")
    op.execute("DROP TRIGGER outbox_tasks_notify ON outbox_tasks")
    op.execute("DROP FUNCTION outbox_notify_tasks()")
