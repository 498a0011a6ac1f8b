"""Several processes serving one listening socket: `outbox receiver --workers N`.

The parent binds and listens on the socket, then starts N worker processes
(spawned: a fresh interpreter each, as on every platform) that each serve it
with their own event loop, database pool and limits; the kernel hands each
new connection to one of them. SIGTERM or SIGINT to the parent is passed on
to every worker as SIGTERM, so each finishes what it is answering, and the
parent returns when all have ended. A worker that ends by itself ends the
service: the others are stopped and the exit status is 1, for the service
manager to restart it whole rather than run on short of a worker.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
BACKLOG = 2048

log = logging.getLogger("outbox.cli")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, for workers to share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening before any worker runs: an early client waits in the backlog.
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _stop_signals() -> Iterator[socket.socket]:
    """A socket that becomes readable when SIGTERM or SIGINT arrives, meanwhile."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    # A handler of our own: the default ones would end (SIGTERM) or interrupt (SIGINT) us.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in STOP_SIGNALS}
    try:
        yield reader
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()


def serve_in_processes(
    count: int, target: Callable[[socket.socket, Any], None], sock: socket.socket, argument: Any
) -> int:
    """Run `target(sock, argument)` in `count` spawned processes until a stop signal or
    one of them ends; the exit status: 0 when stopped by a signal, else 1."""
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=target, args=(sock, argument), name=f"worker-{n}")
        for n in range(count)
    ]
    # Our handlers stay while the workers stop: another signal must not end the parent
    # before them.
    with _stop_signals() as stop:
        for worker in workers:
            worker.start()
        ready = wait([stop, *(worker.sentinel for worker in workers)])
        stopped = stop in ready
        if not stopped:
            ended = next(w for w in workers if w.sentinel in ready)
            log.error(
                "worker %d ended with status %s: stopping the others",
                ended.pid,
                ended.exitcode,
                extra={"fields": {"pid": ended.pid, "exitcode": ended.exitcode}},
            )
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                os.kill(worker.pid, signal.SIGTERM)
        for worker in workers:
            worker.join()
    return 0 if stopped else 1
