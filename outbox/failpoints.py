"""Named failpoints: crash at an exact step, in a child process or in-process.

A process started with ``OUTBOX_FAILPOINT=name`` exits at once with
``EXIT_CODE`` (``os._exit``: no cleanup, no rollback by us, just like a kill)
when it reaches that point. In-process, ``arm(name, skip=n)`` makes the
(n+1)-th arrival raise ``Crash``, a BaseException so ``except Exception``
cannot swallow it. Unarmed, ``hit`` is one dict lookup.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

ENV_VAR = "OUTBOX_FAILPOINT"
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
    }
)


class Crash(BaseException):
    """An armed failpoint was reached: the simulated process dies here."""


_lock = threading.Lock()
_armed: dict[str, int] = {}
_exit_at = os.environ.get(ENV_VAR) or None


def hit(name: str) -> None:
    """Mark arrival at failpoint `name`: exit or raise when it is armed."""
    if _exit_at == name:
        os._exit(EXIT_CODE)
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
