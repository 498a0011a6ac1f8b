"""The states of a task and of a message, and the operators' decisions about dead messages.

docs/explanation/state_machine.md draws the transitions.
"""

from __future__ import annotations

from enum import StrEnum


class TaskState(StrEnum):
    """Where a task is: waiting, leased to a worker, or final (with its reply written)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    HOP_LIMIT = "hop_limit"


class MessageState(StrEnum):
    """Where a message is: waiting, leased to a relay, delivered, given up on, or given up on
    and settled by an operator (resolved: no delivery is needed)."""

    PENDING = "pending"
    SENDING = "sending"
    SENT = "sent"
    DEAD = "dead"
    RESOLVED = "resolved"


class DeadDecision(StrEnum):
    """What an operator decided about a dead message: send it again, or that it needs no
    delivery. Each decision is one audit row."""

    REQUEUE = "requeue"
    RESOLVE = "resolve"


class TaskDecision(StrEnum):
    """What an operator decided about a task. Each decision is one audit row."""

    CANCEL = "cancel"


class ErrorCode(StrEnum):
    """Why a task ended other than `done`: the stable `code` of its reply's `error` object."""

    PERMANENT_FAILURE = "permanent_failure"
    """The handler (or `fail(permanent=True)`) said that trying again cannot succeed."""
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    """A retryable failure on the task's last attempt."""
    LEASE_EXPIRED = "lease_expired"
    """The last attempt's lease expired without a result (its worker stopped or hung)."""
    CANCELLED = "cancelled"
    DEADLINE_PASSED = "deadline_passed"
    HOP_LIMIT = "hop_limit"


TERMINAL_TASK_STATES = tuple(
    s for s in TaskState if s not in (TaskState.PENDING, TaskState.RUNNING)
)
"""The final task states: each writes the task's one reply in the same transaction."""
