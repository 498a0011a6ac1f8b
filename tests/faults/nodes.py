"""Real processes for fault tests, forked from a server that has imported everything.

A fresh interpreter spends about 1.8 s importing SQLAlchemy, aiohttp and
uvicorn on these machines; the crash matrix starts hundreds of processes. A
multiprocessing fork server imports the product once, and each node is a fork
of it: a real process with its own pid, which a failpoint ends with os._exit,
and which SIGKILL, SIGSTOP and SIGTERM reach like any other.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from outbox import failpoints
from outbox.drivers.sqlite.engine import BUSY_TIMEOUT_MS as SQLITE_BUSY_TIMEOUT_MS

# Everything a node imports, the CLI's lazily imported subcommands included: this
# environment may not write bytecode, so a module imported after the fork is
# compiled again in every node.
PRELOAD = [
    "outbox_cli",
    "outbox_cli.demo",
    "outbox.worker",
    "outbox_cli.relay",
    "relay.loop",
    "outbox_cli.receiver",
    "receiver.app",
    "uvicorn",
    "faults.work",
    # Broker destinations and consumers; their client libraries are optional extras, and
    # the fork server skips a preload that fails to import.
    "nats",
    "aio_pika",
    "relay.transports.nats",
    "relay.transports.rabbitmq",
    "outbox_cli.consume",
    "receiver.nats_consumer",
    "receiver.rabbitmq_consumer",
]
# A process waiting for SQLite's write lock sees SIGTERM only when the wait ends, which
# may take the whole busy timeout when many processes share one file on a loaded machine.
STOP_WITHIN = SQLITE_BUSY_TIMEOUT_MS / 1000 + 15
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _enter(target: str, args: Sequence[Any], failpoint: str | None, action: str, log: str) -> None:
    """Child side: route output to the node's log, set the failpoint, run `target(*args)`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # libpq names every session of this process after the node (application_name), so
    # a test can find the node's sessions in pg_stat_activity.
    os.environ["PGAPPNAME"] = multiprocessing.current_process().name
    for variable in (failpoints.ENV_VAR, failpoints.ACTION_VAR, failpoints.SWITCH_VAR):
        os.environ.pop(variable, None)
    if failpoint is not None:
        os.environ.update(failpoints.environment(failpoint, action))
    # The fork server imported the module, and read the variables, before they were set.
    failpoints.read_environment()
    module, _, name = target.partition(":")
    code = getattr(importlib.import_module(module), name)(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code if isinstance(code, int) else 0)


class Node:
    """One forked process: a CLI command or a helper function, maybe set to die at a failpoint."""

    def __init__(
        self,
        name: str,
        target: str,
        args: Sequence[Any],
        log: Path,
        failpoint: str | None = None,
        action: str = "exit",
    ) -> None:
        """Start the process now; at `failpoint` it exits, or stops itself (`action="stop"`)."""
        if failpoint is not None and failpoint not in failpoints.POINTS:
            raise ValueError(f"unknown failpoint {failpoint!r}")
        self.name = name
        self.failpoint = failpoint
        self.log = log
        self.retired = False
        self.process: BaseProcess = _context.Process(
            target=_enter,
            args=(target, list(args), failpoint, action, str(log)),
            name=name,
            daemon=False,
        )
        self.process.start()

    @property
    def pid(self) -> int:
        """The process id."""
        assert self.process.pid is not None
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while running."""
        return self.process.exitcode

    def wait(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for the exit; returns the exit status or None."""
        self.process.join(timeout)
        return self.process.exitcode

    @property
    def paused(self) -> bool:
        """Whether the process is stopped by a signal (state T in /proc)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        # The state follows the command name, which is in parentheses and may hold spaces.
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def died_at_failpoint(self) -> bool:
        """Whether the process ended through its failpoint's os._exit."""
        return self.exitcode == failpoints.EXIT_CODE

    def signal(self, signum: int) -> None:
        """Send `signum` unless the process is gone."""
        if self.alive:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.retired = True
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.process.join(10)

    def stop(self, timeout: float = STOP_WITHIN) -> int | None:
        """SIGTERM, wait for a clean exit, SIGKILL when it does not come."""
        self.retired = True
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.wait(timeout) is None:
            self.kill()
        return self.exitcode

    def tail(self, lines: int = 30) -> str:
        """The end of the node's output, for failure messages."""
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
