"""Reference receiver: dedupe by reply_id and body hash, commit the effect once.

The dedupe core (``ReceiptStore``) is plain Python for integrators to reuse in
their own services; ``create_app`` wraps it in a thin Starlette app, and
``NatsConsumer`` / ``RabbitMQConsumer`` feed it from a broker (their client
libraries are optional extras, imported only when a consumer is built).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outbox.messages import is_reply_id
from outbox.migrations import RECEIVER_BRANCH, upgrade_branch
from receiver.app import create_app
from receiver.errors import StoreUnavailable
from receiver.nats_consumer import NatsConsumer
from receiver.rabbitmq_consumer import RabbitMQConsumer
from receiver.signatures import verify
from receiver.store import Receipt, ReceiptStore

__all__ = [
    "NatsConsumer",
    "RabbitMQConsumer",
    "Receipt",
    "ReceiptStore",
    "StoreUnavailable",
    "create_app",
    "is_reply_id",
    "upgrade",
    "verify",
]


def upgrade(target: str | sa.URL | Engine | Connection) -> None:
    """Create or upgrade the receiver tables only (their own Alembic branch); on a Connection,
    inside its transaction (docs/how-to/alembic.md)."""
    upgrade_branch(target, RECEIVER_BRANCH)
