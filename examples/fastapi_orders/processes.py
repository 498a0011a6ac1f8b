"""The example's processes: started in order, each awaited until it serves, stopped in turn."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from examples.fastapi_orders.deployment import ROOT, Plan, services

READY_WITHIN = 60.0
"""Seconds a process may take to serve before the start is given up."""
STOP_WITHIN = 30.0
"""Seconds a process may take to drain after SIGTERM before it is killed."""
STOP_ORDER = ("app", "worker", "relay", "receiver")
"""No new orders first; the receiver last, so the relay's last deliveries get answers."""


class StartFailed(Exception):
    """A process exited, or did not serve in time, while the stack was starting."""


class Stack:
    """The four processes of a Plan, as children of this one; a context manager."""

    def __init__(self, plan: Plan, logs: Path | None = None) -> None:
        """`logs`: a folder for one <name>.log per process; None shares this terminal."""
        self.plan = plan
        self.services = services(plan)
        self.logs = logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.exit_codes: dict[str, int] = {}

    def __enter__(self) -> Stack:
        """Start every process; the relay only once the receiver it checks at start serves."""
        try:
            for name in self.services:
                self.start(name)
                self.wait_ready(name)
        except BaseException:
            self.stop_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop every process (see stop_all)."""
        self.stop_all()

    def start(self, name: str) -> subprocess.Popen[bytes]:
        """Start one process (again, after kill or stop)."""
        service = self.services[name]
        output: IO[Any] | None = None
        if self.logs is not None:
            output = (self.logs / f"{name}.log").open("ab")
        try:
            # Its own session: Ctrl-C reaches this process alone, which then stops each
            # child with one SIGTERM (a second one makes the worker and relay exit at once).
            process = subprocess.Popen(  # noqa: S603 (our own commands)
                service.argv,
                cwd=ROOT,
                env={**os.environ, **service.env},
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                start_new_session=True,
            )
        finally:
            if output is not None:
                output.close()  # the child holds its own descriptor
        self.processes[name] = process
        self.exit_codes.pop(name, None)
        return process

    def wait_ready(self, name: str, within: float = READY_WITHIN) -> None:
        """Return once the process serves its health URL; StartFailed if it exits first."""
        url = self.services[name].health
        process = self.processes[name]
        deadline = time.monotonic() + within
        pause = threading.Event()
        while url is not None and not _answers(url):
            if process.poll() is not None:
                raise StartFailed(f"{name} exited with status {process.returncode}")
            if time.monotonic() > deadline:
                raise StartFailed(f"{name} did not serve {url} within {within:g}s")
            pause.wait(0.05)

    def exited(self) -> str | None:
        """The name of a process that has exited on its own, if any."""
        return next((n for n, p in self.processes.items() if p.poll() is not None), None)

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crash: no drain) and reap it."""
        process = self.processes.pop(name)
        process.kill()
        self.exit_codes[name] = process.wait()

    def stop(self, name: str) -> int:
        """SIGTERM one process and wait for its drain; SIGKILL after STOP_WITHIN seconds."""
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=STOP_WITHIN)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        self.exit_codes[name] = code
        return code

    def stop_all(self) -> None:
        """Stop every running process, in STOP_ORDER."""
        for name in STOP_ORDER:
            if name in self.processes:
                self.stop(name)


def _answers(url: str) -> bool:
    """Whether GET `url` answers 200 now."""
    try:
        # A loopback http:// URL of our own making.
        with urllib.request.urlopen(url, timeout=1) as answer:  # noqa: S310
            return bool(answer.status == 200)
    except OSError:
        return False
