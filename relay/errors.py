"""The relay's own exceptions, in the one tree under outbox.errors.OutboxError.

OutboxError (outbox.errors)
├── TransportError        the relay's request failed below HTTP
└── SetupRefused          broker setup met a conflict only a destructive change would fix
"""

from __future__ import annotations

from outbox.errors import OutboxError

__all__ = ["SetupRefused", "TransportError"]


class TransportError(OutboxError):
    """The request failed below HTTP: no connection, reset, malformed or oversized answer."""


class SetupRefused(OutboxError):
    """The broker holds something that conflicts with the destination, or refused a change."""
