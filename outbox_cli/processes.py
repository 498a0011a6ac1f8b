"""Several processes serving one listening socket: `outbox receiver --workers N`.

The parent binds and listens on the socket, then starts N worker processes (spawned:
a fresh interpreter each, as on every platform) that each serve it with their own
event loop, database pool and limits; the kernel hands each new connection to one of
them. SIGTERM or SIGINT to the parent is passed on to every worker as SIGTERM, so
each finishes what it is answering, and the parent returns when all have ended; the
workers ignore SIGINT, which a terminal's Ctrl-C sends them too, and leave it to the
parent. Stopping is bounded: workers still running after a grace period (30 s), or
when a stop signal comes while they stop, are killed. A worker that ends by itself
ends the service: the others are stopped and the exit status is 1, for the service
manager to restart it whole rather than run on short of a worker. The status is 1
too when a worker had to be killed, or ended otherwise than as asked even while the
service was stopping: 0 says every worker finished cleanly.

A worker ends with its parent, even a parent killed without a chance to stop them
(SIGKILL, the OOM killer), so a restart finds the port free: on Linux the kernel
sends the worker SIGTERM when the parent dies (PR_SET_PDEATHSIG); elsewhere a thread
in the worker looks for a new parent every second.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
BACKLOG = 2048
SHUTDOWN_GRACE = 30.0
"""Seconds the workers have to finish after SIGTERM before they are killed."""
PARENT_POLL = 1.0
"""Seconds between a worker's looks for a new parent, where the kernel cannot tell it."""
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# How a worker ends when asked: it returns (the receiver's, stopping.sigterm_ends), or
# the SIGTERM it was sent ends it.
ASKED_TO_STOP = (0, -signal.SIGTERM)

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


def _kernel_signals_parent_death(sig: signal.Signals) -> bool:
    """Have Linux send `sig` to this process when its parent ends; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    result: int = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return result == 0


def _watch_parent(parent: int) -> None:
    """SIGTERM this process once `parent` is no longer its parent."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL)
    os.kill(os.getpid(), signal.SIGTERM)


def watch_parent_in_thread(parent: int) -> None:
    """Poll, in a daemon thread, for the end of `parent`: the fallback to the kernel's signal."""
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _end_with_parent(parent: int) -> None:
    """Make this worker get SIGTERM when `parent` ends, however it ends."""
    # The kernel signals when the thread that started us ends: the parent's main thread,
    # which starts the workers and lives as long as the parent does.
    if not _kernel_signals_parent_death(signal.SIGTERM):
        watch_parent_in_thread(parent)
    # A parent that died before the watch began sends nothing: we were adopted already.
    if os.getppid() != parent:
        sys.exit(f"worker {os.getpid()}: parent {parent} ended before it started")


def _run_worker(
    parent: int, target: Callable[[socket.socket, Any], None], sock: socket.socket, argument: Any
) -> None:
    """In a worker process: tie its life to the parent's, then run `target(sock, argument)`."""
    _end_with_parent(parent)
    # Ctrl-C in a terminal reaches the whole process group; the parent answers it for all,
    # with SIGTERM, so a worker's own KeyboardInterrupt does not read as a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target(sock, argument)


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


def _stop(workers: list[BaseProcess], stop: socket.socket, grace: float, insisted: bool) -> None:
    """SIGTERM the workers and wait for them; kill those left after `grace` seconds or at
    another stop signal (`insisted`: one came already)."""
    for worker in workers:
        if worker.is_alive() and worker.pid is not None:
            os.kill(worker.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while not insisted:
        running = [worker.sentinel for worker in workers if worker.is_alive()]
        left = deadline - time.monotonic()
        if not running or left <= 0:
            break
        insisted = stop in wait([stop, *running], timeout=left)
    for worker in workers:
        if worker.is_alive():
            why = "another stop signal" if insisted else f"{grace:g}s passed"
            log.error(
                "worker %d still running after %s: killing it",
                worker.pid,
                why,
                extra={"fields": {"pid": worker.pid, "why": why}},
            )
            worker.kill()
    for worker in workers:
        worker.join()


def serve_in_processes(
    count: int,
    target: Callable[[socket.socket, Any], None],
    sock: socket.socket,
    argument: Any,
    grace: float = SHUTDOWN_GRACE,
) -> int:
    """Run `target(sock, argument)` in `count` spawned processes until a stop signal or
    one of them ends; the exit status: 0 when all stopped as asked by a signal, else 1."""
    context = multiprocessing.get_context("spawn")
    workers: list[BaseProcess] = [
        context.Process(
            target=_run_worker, args=(os.getpid(), target, sock, argument), name=f"worker-{n}"
        )
        for n in range(count)
    ]
    # Our handlers stay while the workers stop: another signal must not end the parent
    # before them, but kill them.
    with _stop_signals() as stop:
        for worker in workers:
            worker.start()
        ready = wait([stop, *(worker.sentinel for worker in workers)])
        stopped = stop in ready
        # The wakeup socket holds a byte per signal: two already mean "stop now".
        insisted = stopped and len(stop.recv(64)) > 1
        if not stopped:
            ended = next(w for w in workers if w.sentinel in ready)
            log.error(
                "worker %d ended with status %s: stopping the others",
                ended.pid,
                ended.exitcode,
                extra={"fields": {"pid": ended.pid, "exitcode": ended.exitcode}},
            )
        _stop(workers, stop, grace, insisted)
    # A worker may have ended by itself at the moment the stop signal came: its status
    # tells, not which came first.
    clean = all(worker.exitcode in ASKED_TO_STOP for worker in workers)
    return 0 if stopped and clean else 1
