"""The notifications family of the driver interface: wake-ups when work arrives.

A backend with notifications (PostgreSQL's LISTEN/NOTIFY) hands out a listener on a
channel its triggers notify; one without (SQLite) hands out none, and whoever asked
polls alone. Notifications are never durable: a listener only makes an idle process
look sooner, so the callers poll as well.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import sqlalchemy as sa


class Wakeups(Protocol):
    """A listener kept up by keep_listening(); `listening` is set while it is connected."""

    listening: threading.Event

    async def keep_listening(self) -> None:
        """Connect and listen, and again after each loss; runs until cancelled."""
        ...

    async def clear(self) -> None:
        """Discard the notifications received so far (just before a claim)."""
        ...

    async def wait(self, timeout: float) -> None:
        """Return at the first notification since `clear`, or after `timeout` seconds."""
        ...


class NotificationsDriver(Protocol):
    """Wake-ups on a channel, where the backend has them."""

    def listener(
        self,
        engine: sa.Engine,
        channel: str,
        retry: float,
        listening: threading.Event,
        on_notify: Callable[[], None] | None = None,
        logger: logging.Logger | None = None,
    ) -> Wakeups | None:
        """A listener on `channel` of `engine`'s database, or None where the backend has no
        notifications. `retry`: the pause after a failed connection; `on_notify`: called
        per notification and per (re)connection, if given (else read with clear and wait)."""
        ...


class PollingOnly:
    """A backend without notifications (SQLite, MySQL): no listener, whoever asked polls."""

    def listener(
        self,
        engine: sa.Engine,
        channel: str,
        retry: float,
        listening: threading.Event,
        on_notify: Callable[[], None] | None = None,
        logger: logging.Logger | None = None,
    ) -> Wakeups | None:
        """None: no notifications on this backend."""
        return None
