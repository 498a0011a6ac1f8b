"""Named failpoints: crash at an exact step, in a child process or in-process.

A process started with ``OUTBOX_FAILPOINT=name`` and the testing switch
``OUTBOX_FAILPOINTS_ENABLED=1`` exits at once with ``EXIT_CODE`` (``os._exit``:
no cleanup, no rollback by us, just like a kill) when it reaches that point.
With ``OUTBOX_FAILPOINT_ACTION=stop`` it instead stops itself with SIGSTOP the
first time it gets there (POSIX only), so a test can hold a process at an exact
step, look at the database, and then resume it (SIGCONT) or kill it.

The switch is a second, deliberate act: a failpoint name alone, left in a
shared environment file, is inert, and the process says so in a WARNING at
start; an armed one is named in a WARNING at start too. A bad value is a
ConfigError: a command's one-line error at start, the library's at the first
`hit`; importing the package never fails on it.

Every ``*.before_commit`` point sits after its transaction's statements ran and
before its COMMIT, so a process dying there leaves the database holding
uncommitted writes. Where the product commits one statement in autocommit, it
asks `armed()` first and, only then, runs that statement in a transaction.

In-process, ``arm(name, skip=n)`` makes the (n+1)-th arrival raise ``Crash``, a
BaseException so ``except Exception`` cannot swallow it; being a call in test
code, it needs no switch. Unarmed, ``hit`` is two comparisons and one dict test.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from outbox.errors import ConfigError

ENV_VAR = "OUTBOX_FAILPOINT"
ACTION_VAR = "OUTBOX_FAILPOINT_ACTION"
SWITCH_VAR = "OUTBOX_FAILPOINTS_ENABLED"
"""The testing switch: ENV_VAR acts only when this is "1"."""
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

log = logging.getLogger(__name__)


class Crash(BaseException):
    """An armed failpoint was reached: the simulated process dies here."""


_lock = threading.Lock()
_armed: dict[str, int] = {}
_exit_at: str | None = None
_action = "exit"
_problem: str | None = None  # why the environment's failpoint variables are unusable
_ignored: str | None = None  # a failpoint named without the switch
_announced = False


def read_environment() -> None:
    """Take the process's failpoint from the environment (done at import; again after a fork).

    Neither raises nor logs: at import, an error would break ``import outbox`` in the
    application, and a log line would come before the command configured logging. The
    command line calls `check` and `announce`; the library, in a process of its own,
    announces at its first failpoint and raises there when the values are unusable.
    """
    global _exit_at, _action, _problem, _ignored, _announced
    point = os.environ.get(ENV_VAR) or None
    action = os.environ.get(ACTION_VAR) or "exit"
    switch = os.environ.get(SWITCH_VAR) or "0"
    _exit_at, _action, _problem, _ignored, _announced = None, "exit", None, None, False
    if switch not in ("0", "1"):
        _problem = f"{SWITCH_VAR} must be 1 or 0, got {switch!r}"
    elif point is None:
        pass
    elif switch != "1":
        _ignored = point
    elif point not in POINTS:
        _problem = f"{ENV_VAR}: unknown failpoint {point!r}"
    elif action not in ACTIONS:
        _problem = f"{ACTION_VAR} must be one of {ACTIONS}, got {action!r}"
    else:
        _exit_at, _action = point, action
    # Nothing to say: `hit` then spends one test of a flag on announcing.
    _announced = _exit_at is None and _ignored is None


def check() -> None:
    """Raise ConfigError when the failpoint variables hold an unusable value."""
    if _problem is not None:
        raise ConfigError(_problem)


def announce() -> None:
    """Log, once, that a failpoint is armed or that one is set but ignored (after `check`)."""
    global _announced
    if _announced:
        return
    _announced = True
    if _ignored is not None:
        log.warning(
            "%s=%s is ignored: failpoints act only with the testing switch %s=1",
            ENV_VAR,
            _ignored,
            SWITCH_VAR,
        )
    elif _exit_at is not None:
        log.warning(
            "failpoint %s is armed (%s): this process will %s when it reaches it; "
            "a testing switch, never for production",
            _exit_at,
            SWITCH_VAR,
            f"exit with status {EXIT_CODE}" if _action == "exit" else "stop itself (SIGSTOP)",
        )


def environment(point: str, action: str = "exit") -> dict[str, str]:
    """The variables that arm failpoint `point` in a child process, the switch included."""
    if point not in POINTS:
        raise ValueError(f"unknown failpoint {point!r}; known: {', '.join(sorted(POINTS))}")
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
    return {ENV_VAR: point, ACTION_VAR: action, SWITCH_VAR: "1"}


def armed(name: str) -> bool:
    """Whether failpoint `name` may act at its next arrival (by environment or arm())."""
    return _exit_at == name or name in _armed


def hit(name: str) -> None:
    """Mark arrival at failpoint `name`: exit, stop or raise when it is armed."""
    if not _announced:  # a process that never called announce() still says it at once
        announce()
    if _exit_at == name:
        _reached(name)
    if _problem is not None:
        # A process meant to die at a step must not run on as if unarmed.
        raise ConfigError(_problem)
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


def _reached(name: str) -> None:
    global _exit_at
    # The log says where the process died: a test counts a kill by it, not by a guess.
    log.warning("failpoint %s reached: %s", name, _action)
    if _action == "stop":
        _exit_at = None  # one stop per process: after SIGCONT it runs on normally
        # Directed at this thread, which then stops before it returns: sent to the
        # process, the kernel may let another thread start the stop while this one runs
        # on for a moment, long enough to COMMIT.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
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
