"""The receiver's own exceptions, in the one tree under outbox.errors.OutboxError.

OutboxError (outbox.errors)
└── StoreUnavailable      the receipt database cannot be reached or stays busy
"""

from __future__ import annotations

from outbox.errors import OutboxError

__all__ = ["StoreUnavailable"]


class StoreUnavailable(OutboxError):
    """The receipt database is unreachable or busy; nothing is known to be stored: retry."""
