"""How the relay and receiver processes of a run are started: plainly, or wrapped.

relay_bench starts every relay and receiver process through the launcher in effect
(`launching`): by default our interpreter as it is. A comparison of how those processes
are run (benchmarks.trace_cost: under `opentelemetry-instrument`, or with an optional
module blocked) sets another launcher around a drain or a live run, so the run itself is
the suite's own, unchanged. The producers and the benchmark's own process are never
wrapped: only what the launcher starts is compared.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Launcher:
    """A command to run our interpreter under (`prefix`) and variables to add to the
    environment (`env`); PYTHONPATH is put before the inherited one, not over it."""

    name: str
    prefix: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def command(self, *args: str) -> list[str]:
        """Our interpreter with `args`, under the prefix."""
        return [*self.prefix, sys.executable, *args]

    def environment(self) -> dict[str, str]:
        """The environment of a process it starts: ours with its variables."""
        env = {**os.environ, **self.env}
        inherited = os.environ.get("PYTHONPATH")
        if "PYTHONPATH" in self.env and inherited:
            env["PYTHONPATH"] = os.pathsep.join((self.env["PYTHONPATH"], inherited))
        return env


PLAIN = Launcher("plain")
"""Our interpreter as it is, in our environment: how every run starts its processes."""

_current: ContextVar[Launcher] = ContextVar("launcher", default=PLAIN)


def current() -> Launcher:
    """The launcher in effect: PLAIN unless inside `launching`."""
    return _current.get()


@contextmanager
def launching(launcher: Launcher) -> Iterator[Launcher]:
    """Start the relay and receiver processes of what runs inside with `launcher`."""
    token = _current.set(launcher)
    try:
        yield launcher
    finally:
        _current.reset(token)
