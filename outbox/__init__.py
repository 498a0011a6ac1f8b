"""Transactional outbox: results leave the database exactly when they commit.

What a service touches: publish() inside its own transaction, TaskQueue and
Worker for tasks, the schema upgrade (in a service's own Alembic too, with the
autogenerate filters of outbox.alembic_filters), and the errors (outbox.errors).
Tests take ManualClock and failpoints from outbox.testing.
"""

from __future__ import annotations

from outbox.claim import Claim
from outbox.db.dialect import create_engine
from outbox.errors import (
    BatchFailed,
    Fenced,
    InvalidEnvelope,
    InvalidMessage,
    OutboxError,
    PayloadCollision,
    PermanentFailure,
    SchemaNotReady,
    Unauthorized,
)
from outbox.intake import Ack, AuthContext, Envelope
from outbox.migrations import upgrade
from outbox.publish import publish
from outbox.states import ErrorCode, MessageState, TaskState
from outbox.tasks import TaskQueue
from outbox.worker import Worker

__version__ = "0.1.0"
"""The release, read by the build (pyproject's [tool.hatch.version]) and `outbox --version`."""

__all__ = [
    "Ack",
    "AuthContext",
    "BatchFailed",
    "Claim",
    "Envelope",
    "ErrorCode",
    "Fenced",
    "InvalidEnvelope",
    "InvalidMessage",
    "MessageState",
    "OutboxError",
    "PayloadCollision",
    "PermanentFailure",
    "SchemaNotReady",
    "TaskQueue",
    "TaskState",
    "Unauthorized",
    "Worker",
    "create_engine",
    "publish",
    "upgrade",
]
