"""Whether a command runs as its own process's command line, which service set-up is for.

A service command (relay, worker, receiver, consume) run as the process's own
command line (the `outbox` script, `python -m outbox_cli`) tunes the process's
collector (outbox.process_gc). Run through `main([...])` inside another program's
process, a test runner's say, it leaves that process's collector as it is: freezing
a host's heap would keep its garbage, and its own leaks, for good.
"""

from __future__ import annotations

from outbox.process_gc import tune_for_long_run

_own = False


def run_as_command() -> None:
    """Mark this process as the command's own: its command line is the `outbox` command's."""
    global _own
    _own = True


def tune_if_own_process() -> None:
    """Tune the collector for a long run, only in the command's own process."""
    if _own:
        tune_for_long_run()
