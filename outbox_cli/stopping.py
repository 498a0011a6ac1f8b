"""SIGTERM and SIGINT before a long-running command handles them itself: stop, say so, exit 0.

The worker, the relay, the receivers and the console each install their own stop
handling once they run (a drain, uvicorn's shutdown). Before that they connect to the
database, and a connect to an address that accepts and never answers has no end of its
own: SIGTERM's default action ended the process without a word, SIGINT with a
KeyboardInterrupt traceback. Meanwhile both now raise StopSignal in the main thread,
which ends any wait there (psycopg's connect included) and is reported as a stop asked
for. uvicorn restores these handlers when it has shut down and raises the signal it
caught again: that too ends here, as the clean stop it was.

A process of `outbox receiver --workers N` is no command line of its own: its SIGTERM
ends the block it serves in (sigterm_ends), for the same reason. Ended by the signal's
default action instead, a process skips its `finally` blocks and its exit handlers,
where an OpenTelemetry SDK exports the spans it still holds.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RECEIVER_SERVICES = (None, "consume")
"""`outbox receiver` serving HTTP (no action) or consuming: not `upgrade` or `purge`."""


class StopSignal(KeyboardInterrupt):
    """SIGTERM or SIGINT came: a KeyboardInterrupt, so code that cleans up after one
    (psycopg cancelling its connect, asyncio ending its loop) does the same for both."""

    def __init__(self, signum: int) -> None:
        """Remember which signal it was."""
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def runs_until_stopped(args: argparse.Namespace) -> bool:
    """Whether the command runs until a stop signal (and a stop is then its normal end)."""
    if args.command in ("worker", "relay", "console"):
        return True
    return args.command == "receiver" and getattr(args, "receiver_command", None) in (
        RECEIVER_SERVICES
    )


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise StopSignal(signum)


@contextlib.contextmanager
def sigterm_ends() -> Iterator[None]:
    """While inside, SIGTERM raises StopSignal in the main thread, which ends the block
    quietly, so the process goes on to exit normally; SIGINT is left as it is."""
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        yield
    except StopSignal:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_signals_raise(enabled: bool) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT raise StopSignal unless the command installed its
    own handlers; the previous ones are back on the way out (main() runs inside tests)."""
    # Only the main thread may set handlers, and only it runs them.
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
