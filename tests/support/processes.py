"""Child processes of a test: generous start-up deadlines, and never one left running.

A fresh interpreter that imports the product takes well under a second on a quiet
machine, but many seconds when every core is busy with other tests; waits for a
child to start, log or answer use PROCESS_START, which only a hung child outlasts.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

PROCESS_START = 120.0
"""Seconds a test waits for a child to start and log, answer or reach a point: a receiver
with --workers 2, three interpreters starting at once, took over 60 s on a loaded machine."""
PROCESS_EXIT = 60.0
"""Seconds a test waits for a child it asked to stop (SIGTERM, SIGINT) to exit."""


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill `proc` if it still runs (its whole group when it leads one) and wait for it.

    Reaped here, a child killed on a test's failure path cannot outlive the test, nor
    surface later as another test's "subprocess still running" warning.
    """
    if proc.poll() is None:
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except ProcessLookupError:
            pass
    # communicate() also closes the pipes the child was given, which a bare wait() leaves.
    proc.communicate()


@contextmanager
def spawned(command: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """`subprocess.Popen(command, **popen)`, killed and reaped on the way out, pass or fail."""
    proc = subprocess.Popen(command, **popen)
    try:
        yield proc
    finally:
        reap(proc)
