"""The core's exceptions, root of the one tree; each docstring is the meaning of its message.

The relay's and the receiver's own errors subclass OutboxError in relay.errors
(TransportError) and receiver.errors (StoreUnavailable), so one `except OutboxError`
still catches every error the toolkit raises on purpose.

OutboxError
├── Unauthorized          the caller is not an allowed, authenticated source
├── InvalidEnvelope       (also ValueError) an intake envelope breaks a rule
├── InvalidMessage        (also ValueError) a publish() argument or a task result breaks a rule
├── PayloadCollision      one identity, two different contents
├── Fenced                the caller's lease is gone: a newer owner or a final state
├── BatchFailed           receive_batch stopped; carries the committed prefix
├── SchemaNotReady        the database schema is missing or older than the code
├── PermanentFailure      raised by a worker's handler: fail the task now, no retry
├── RequeueRefused        a requeue found the message missing or not dead
├── ResolveRefused        a resolve found the message missing or not dead
├── NotDead               a decision named a reply_id that is no dead message
├── TaskNotCancelled      a cancel named a task that is final already, or none
├── ConfigError           (also ValueError) a configuration (file, variables) is unusable
└── SignatureError        a request is not signed by a current secret in time
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outbox.intake import Ack


class OutboxError(Exception):
    """Base of every error this library raises on purpose."""


class Unauthorized(OutboxError):
    """The authentication context does not allow this source to submit the envelope."""


class InvalidEnvelope(OutboxError, ValueError):
    """The envelope breaks an intake rule; nothing was written."""


class InvalidMessage(OutboxError, ValueError):
    """An outbox message argument breaks a rule; nothing was written."""


class PayloadCollision(OutboxError):
    """The same identity was already stored with a different content hash; nothing changed."""


class Fenced(OutboxError):
    """The lease no longer holds (newer fence, other owner, expired or finished); stop work."""


class BatchFailed(OutboxError):
    """A batch stopped at `index`; the ACKs in `committed` were stored before it."""

    def __init__(self, index: int, committed: Sequence[Ack], cause: BaseException) -> None:
        super().__init__(f"batch item {index} failed: {cause}")
        self.index = index
        self.committed = list(committed)
        self.cause = cause


class SchemaNotReady(OutboxError):
    """The database schema is missing or older than this code; run the upgrade command."""


class PermanentFailure(OutboxError):
    """Raised by a handler: fail the task now, without further attempts."""


class RequeueRefused(OutboxError):
    """Nothing to requeue: the message is missing or not dead (perhaps requeued or resolved
    meanwhile); nothing was changed."""


class ResolveRefused(OutboxError):
    """Nothing to resolve: the message is missing or not dead (perhaps requeued or resolved
    meanwhile); nothing was changed."""


class NotDead(OutboxError):
    """A decision named a reply_id that is no dead message; nothing was asked or changed.

    `state` is the message's state, or None when there is no such message.
    """

    def __init__(self, reply_id: str, state: str | None) -> None:
        found = "no message" if state is None else f"message is {state}, not dead:"
        super().__init__(f"{found} {reply_id!r}")
        self.reply_id = reply_id
        self.state = state


class TaskNotCancelled(OutboxError):
    """A cancel named a task that is final already, or no task; nothing was changed.

    `state` is the task's state, or None when there is no such task.
    """

    def __init__(self, task_id: str, state: str | None) -> None:
        found = "no task" if state is None else f"task is {state} (final), not cancelled:"
        super().__init__(f"{found} {task_id!r}")
        self.task_id = task_id
        self.state = state


class ConfigError(OutboxError, ValueError):
    """A configuration is unusable; the message says which setting and why."""


class SignatureError(OutboxError):
    """The request is not signed by a current secret within the timestamp tolerance."""
