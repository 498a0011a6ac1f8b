"""Transactional outbox: results leave the database exactly when they commit."""

from __future__ import annotations

from outbox import failpoints
from outbox._dialect import create_engine
from outbox.clock import ManualClock
from outbox.errors import (
    BatchFailed,
    Fenced,
    InvalidEnvelope,
    InvalidMessage,
    OutboxError,
    PayloadCollision,
    SchemaNotReady,
    Unauthorized,
)
from outbox.intake import Ack, AuthContext, Envelope
from outbox.migrations import upgrade
from outbox.publish import publish
from outbox.tasks import Claim, TaskQueue

__all__ = [
    "Ack",
    "AuthContext",
    "BatchFailed",
    "Claim",
    "Envelope",
    "Fenced",
    "InvalidEnvelope",
    "InvalidMessage",
    "ManualClock",
    "OutboxError",
    "PayloadCollision",
    "SchemaNotReady",
    "TaskQueue",
    "Unauthorized",
    "create_engine",
    "failpoints",
    "publish",
    "upgrade",
]
