"""The relay's event loop, and a wait that a stop cuts short."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("outbox.relay")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (the `fast` extra): HTTP costs less CPU on it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


CANCEL_WAIT = 1.0
"""Seconds close() waits for the tasks it cancels to end."""


def cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks still on `loop` and let them end, as asyncio.run does before it
    closes its loop: a client library's background tasks (a NATS subscription's reader
    after its server went away) would otherwise be collected after the loop closed, and
    fail there. A task that will not end within CANCEL_WAIT, or that fails as it ends, is
    logged: closing goes on."""
    remaining = asyncio.all_tasks(loop)
    if not remaining:
        return
    for task in remaining:
        task.cancel()
    done, pending = loop.run_until_complete(asyncio.wait(remaining, timeout=CANCEL_WAIT))
    for task in pending:
        log.warning("closing: a task did not end when cancelled: %r", task)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("closing: a task failed as it ended: %r", task.exception())


async def done_unless_stopped(work: Awaitable[None], stop: asyncio.Future[Any]) -> bool:
    """Run `work` unless `stop` comes first: True when it ended, False when it was cancelled.

    An exception of `work` is raised as it was.
    """
    running = asyncio.ensure_future(work)
    try:
        await asyncio.wait({running, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not running.done():
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    if running.cancelled():
        return False
    running.result()
    return True


@contextmanager
def stopping_on_signals(
    loop: asyncio.AbstractEventLoop, stop: Callable[[], None], install: bool
) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call `stop` when `install`; their defaults
    after it."""
    signals = (signal.SIGTERM, signal.SIGINT) if install else ()
    for signum in signals:
        loop.add_signal_handler(signum, stop)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
