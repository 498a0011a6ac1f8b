"""How a broker consumer stops: a request from anywhere (a signal handler too), and waits
that end early when it comes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
CANCEL_AGAIN = 0.1
"""Seconds between cancellations of a wait that a stop ends (see unless_stopped)."""

log = logging.getLogger("outbox.receiver.consume")


class Stoppable:
    """A stop request, and the waits it cuts short: pause, wait_stopped, unless_stopped."""

    def __init__(self) -> None:
        """Not stopping."""
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False

    @property
    def stopping(self) -> bool:
        """Whether stop() was called."""
        return self._stop_requested

    def stop(self) -> None:
        """Stop after the messages in hand are committed and settled (callable from a signal)."""
        self._stop_requested = True
        if self._stopping is not None:
            self._stopping.set()

    def _stop_event(self) -> asyncio.Event:
        if self._stopping is None:
            self._stopping = asyncio.Event()
            if self._stop_requested:
                self._stopping.set()
        return self._stopping

    async def pause(self, seconds: float) -> None:
        """Wait `seconds`, or less when stop() is called meanwhile."""
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event().wait(), seconds)

    async def wait_stopped(self) -> None:
        """Return once stop() has been called."""
        await self._stop_event().wait()

    async def unless_stopped(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None when stop() comes first and `work` is cancelled.

        For waits with no end of their own, such as a client library's connect that
        retries an unreachable server for ever: a signal must still end the process.
        """
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stop_event().wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()  # the caller was cancelled: the work must not run on alone
            raise
        finally:
            stopped.cancel()
        if task.done():
            return task.result()
        # Cancelled until it takes: on Python 3.11 a wait_for inside `work` (nats-py's
        # connect has some) can swallow a cancellation that lands as its wait ends, and
        # the client's retry loop then goes on as if nothing had happened.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_AGAIN)
        if task.cancelled():
            return None
        if task.exception() is not None:
            # Failed as the stop came (a client may turn the cancellation into its own
            # error): the stop is the answer, not the failure.
            log.debug("stopped while waiting: %r", task.exception())
            return None
        return task.result()  # it ended as the stop came: the caller closes what it holds
