"""Named failpoints: crash at an exact step, in a child process or in-process.

A process started with ``OUTBOX_FAILPOINT=name`` exits at once with
``EXIT_CODE`` (``os._exit``: no cleanup, no rollback by us, just like a kill)
when it reaches that point. With ``OUTBOX_FAILPOINT_ACTION=stop`` it instead
stops itself with SIGSTOP the first time it gets there (POSIX only), so a test
can hold a process at an exact step and resume it with SIGCONT. In-process,
``arm(name, skip=n)`` makes the (n+1)-th arrival raise ``Crash``, a
BaseException so ``except Exception`` cannot swallow it. Unarmed, ``hit`` is one dict lookup.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

ENV_VAR = "OUTBOX_FAILPOINT"
ACTION_VAR = "OUTBOX_FAILPOINT_ACTION"
ACTIONS = ("exit", "stop")
EXIT_CODE = 86

POINTS = frozenset(
    {
        "intake.before_commit",
        "intake.after_commit",
        "claim.before_commit",
        "claim.after_commit",
        "finish.before_commit",
        "finish.after_commit",
        "relay.after_claim",
        "relay.after_remote_commit",
        "relay.before_sent_commit",
        "relay.after_sent_commit",
        "receiver.before_commit",
        "receiver.after_commit",
        "receiver.consume.before_ack",
    }
)


class Crash(BaseException):
    """An armed failpoint was reached: the simulated process dies here."""


_lock = threading.Lock()
_armed: dict[str, int] = {}
_exit_at: str | None = None
_action = "exit"


def read_environment() -> None:
    """Take the process's failpoint from the environment (done at import; again after a fork)."""
    global _exit_at, _action
    point = os.environ.get(ENV_VAR) or None
    action = os.environ.get(ACTION_VAR) or "exit"
    if point is not None and point not in POINTS:
        raise ValueError(f"{ENV_VAR}: unknown failpoint {point!r}")
    if action not in ACTIONS:
        raise ValueError(f"{ACTION_VAR} must be one of {ACTIONS}, got {action!r}")
    _exit_at, _action = point, action


def hit(name: str) -> None:
    """Mark arrival at failpoint `name`: exit, stop or raise when it is armed."""
    if _exit_at == name:
        _reached()
    if not _armed:
        return
    with _lock:
        remaining = _armed.get(name)
        if remaining is None:
            return
        if remaining > 0:
            _armed[name] = remaining - 1
            return
        del _armed[name]
    raise Crash(name)


def _reached() -> None:
    global _exit_at
    if _action == "stop":
        _exit_at = None  # one stop per process: after SIGCONT it runs on normally
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    os._exit(EXIT_CODE)


read_environment()


@contextmanager
def arm(name: str, skip: int = 0) -> Iterator[None]:
    """Within the block, the (skip+1)-th arrival at `name` raises Crash."""
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(POINTS))}")
    if skip < 0:
        raise ValueError("skip must be >= 0")
    with _lock:
        if name in _armed:
            raise RuntimeError(f"failpoint {name!r} is already armed")
        _armed[name] = skip
    try:
        yield
    finally:
        with _lock:
            _armed.pop(name, None)
