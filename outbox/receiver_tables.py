"""The receiver's tables: receipts for dedupe, the reference effect table, dead letters.

They have a MetaData and a migration branch of their own (alembic/versions/receiver): a
service that only publishes never creates them. The core describes them because the
database drivers (outbox.drivers) hold every statement the products run, the
receiver's included.
"""

from __future__ import annotations

import sqlalchemy as sa

from outbox.ddl import TABLE_OPTIONS, LongBinary, LongText
from outbox.schema import NAMING_CONVENTION, BigIdentity, Epoch

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)

receipts = sa.Table(
    "receiver_receipts",
    metadata,
    sa.Column("reply_id", sa.String(200), primary_key=True),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("body", LongBinary, nullable=False),
    sa.Column("received_at", Epoch(), nullable=False),
    sa.Index("ix_receiver_receipts_received_at", "received_at"),
    **TABLE_OPTIONS,
)

# Deliberately not unique on reply_id: a duplicated effect must be countable, not hidden.
effects = sa.Table(
    "receiver_effects",
    metadata,
    sa.Column("id", BigIdentity, primary_key=True, autoincrement=True),
    sa.Column("reply_id", sa.String(200), nullable=False, index=True),
    sa.Column("body", LongBinary, nullable=False),
    sa.Column("created_at", Epoch(), nullable=False),
    **TABLE_OPTIONS,
)

# Messages a broker consumer gave up on: their effect kept raising. Not a receipt: nothing
# of them was applied, and `outbox receiver dead retry` may still apply them.
dead_letters = sa.Table(
    "receiver_dead_letters",
    metadata,
    sa.Column("reply_id", sa.String(200), primary_key=True),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("body", LongBinary, nullable=False),
    sa.Column("headers", LongText, nullable=False),
    sa.Column("reason", LongText, nullable=False),
    sa.Column("failures", sa.Integer(), nullable=False),
    sa.Column("deliveries", sa.Integer()),
    sa.Column("broker", sa.String(20)),
    sa.Column("broker_ref", sa.String(400)),
    sa.Column("dead_at", Epoch(), nullable=False),
    sa.Index("ix_receiver_dead_letters_dead_at", "dead_at"),
    **TABLE_OPTIONS,
)
