"""Worker targets for `serve_in_processes` that misbehave on purpose, importable when spawned."""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any


def stubborn(sock: socket.socket, events: Any) -> None:
    """Say it is ready, then note each SIGTERM (on `events`' second) and carry on regardless."""
    ready, asked = events
    signal.signal(signal.SIGTERM, lambda *_: asked.set())
    ready.set()
    while True:
        signal.pause()


def stops_the_service_and_fails(sock: socket.socket, argument: Any) -> None:
    """Send the parent a stop signal, then end at once with a failure of its own."""
    # The parent's SIGTERM must not be what ends it: the failure is its own.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.kill(os.getppid(), signal.SIGTERM)
    sys.exit(3)
