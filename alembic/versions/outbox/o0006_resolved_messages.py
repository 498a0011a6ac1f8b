"""outbox: a dead message can be resolved (needs no delivery); the audit says which decision

Revision ID: o0006
Revises: o0005
Create Date: 2026-12-02

`resolved` joins the message states, reached from `dead` by `outbox dead resolve`;
`resolved_at` ages resolved rows for `outbox purge`. The requeue audit becomes the
audit of both decisions: every row says its `action`, and the rows written before
this revision were requeues.

Downgrade: the older code knows no `resolved`, so every resolved message becomes
`dead` again, where the operator's decision found it (nothing is sent, nothing is
deleted). The older audit has no `action`, so a resolve's row keeps its place with
RESOLVE_UNDONE before its reason; upgrading again reads that back as a resolve.

On SQLite the two tables are rebuilt (batch mode: SQLite cannot alter a CHECK
constraint), copying every row; on PostgreSQL the new state CHECK reads every
message once while it holds the table's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "o0006"
down_revision: str | None = "o0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATE_CHECK = "ck_outbox_messages_state"
ACTION_CHECK = "ck_outbox_requeues_action"
FOUR_STATES = "state IN ('pending', 'sending', 'sent', 'dead')"
FIVE_STATES = "state IN ('pending', 'sending', 'sent', 'dead', 'resolved')"
ACTIONS = "action IN ('requeue', 'resolve')"
RESOLVE_UNDONE = "resolve (undone by downgrade): "

messages = sa.table("outbox_messages", sa.column("state", sa.String()))
audit = sa.table(
    "outbox_requeues", sa.column("action", sa.String()), sa.column("reason", sa.Text())
)


def upgrade() -> None:
    with op.batch_alter_table("outbox_messages") as batch:
        batch.drop_constraint(op.f(STATE_CHECK), type_="check")
        batch.create_check_constraint(op.f(STATE_CHECK), sa.text(FIVE_STATES))
        batch.add_column(sa.Column("resolved_at", sa.Double(), nullable=True))
    # The default fills the rows already there, all requeues; dropped afterwards, so
    # every later row names its decision.
    op.add_column(
        "outbox_requeues",
        sa.Column("action", sa.String(16), nullable=False, server_default="requeue"),
    )
    op.execute(
        audit.update()
        .where(audit.c.reason.startswith(RESOLVE_UNDONE, autoescape=True))
        .values(action="resolve")
    )
    with op.batch_alter_table("outbox_requeues") as batch:
        batch.alter_column("action", existing_type=sa.String(16), server_default=None)
        batch.create_check_constraint(op.f(ACTION_CHECK), sa.text(ACTIONS))


def downgrade() -> None:
    op.execute(messages.update().where(messages.c.state == "resolved").values(state="dead"))
    op.execute(
        audit.update()
        .where(audit.c.action == "resolve")
        .values(reason=sa.literal(RESOLVE_UNDONE) + audit.c.reason)
    )
    with op.batch_alter_table("outbox_requeues") as batch:
        batch.drop_constraint(op.f(ACTION_CHECK), type_="check")
        batch.drop_column("action")
    with op.batch_alter_table("outbox_messages") as batch:
        batch.drop_column("resolved_at")
        batch.drop_constraint(op.f(STATE_CHECK), type_="check")
        batch.create_check_constraint(op.f(STATE_CHECK), sa.text(FOUR_STATES))
