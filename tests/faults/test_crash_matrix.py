"""Crash matrix: a real process dies at every failpoint, then recovers.

The failpoints: docs/explanation/contract.md#failure-windows-and-guarantees.

For each point, rounds of `WIDTH` processes of the role under test start with
the failpoint armed and each dies there (exit 86, os._exit: no cleanup), while
the other roles run normally. At a `*.before_commit` point each process instead
stops there and is SIGKILLed once the database is seen holding its uncommitted
writes, and its transaction is then seen rolled back (faults.commit_window): a
kill is counted only where it happened. A replacement starts without the
failpoint and the system drains; the invariant checker then finds nothing lost,
duplicated, stuck or unexpected, and no reply dead. The receiver listens on one
port, so its points run one process per round.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.commit_window import POINTS as COMMIT_WINDOWS
from faults.commit_window import kill_in_commit_window
from faults.figures import record_then_assert
from faults.invariants import Tally
from faults.nodes import Node
from faults.system import System
from outbox import failpoints

ROLE_OF = {
    "intake.before_commit": "intake",
    "intake.after_commit": "intake",
    "claim.before_commit": "worker",
    "claim.after_commit": "worker",
    "finish.before_commit": "worker",
    "finish.after_commit": "worker",
    "relay.after_claim": "relay",
    "relay.after_remote_commit": "relay",
    "relay.before_sent_commit": "relay",
    "relay.after_sent_commit": "relay",
    "receiver.before_commit": "receiver",
    "receiver.after_commit": "receiver",
}
WIDTH = 5
RUNS = 10
SOAK_RUNS = 100
DIE_WITHIN = 30.0


# Failpoints of processes outside this HTTP system, each with its own crash proof.
PROVED_ELSEWHERE = {
    "receiver.consume.before_ack": "tests/receiver/test_consume_crash.py",
}


def test_every_failpoint_is_in_the_matrix() -> None:
    """A failpoint added to the product without a row here (or a proof named) fails this test."""
    assert set(ROLE_OF) | set(PROVED_ELSEWHERE) == failpoints.POINTS
    assert not set(ROLE_OF) & set(PROVED_ELSEWHERE)


def died_there(nodes: list[Node], point: str, system: System) -> int:
    """Wait for each node to die at `point`; returns how many did."""
    for node in nodes:
        node.wait(DIE_WITHIN)
        assert node.died_at_failpoint(), (
            f"{node.name} did not die at {point} (exit {node.exitcode})\n{system.logs()}"
        )
    return len(nodes)


def killed_there(nodes: list[Node], point: str, system: System) -> int:
    """Each node dies at `point`, inside its commit window at a before-commit point; returns
    how many did."""
    if point in COMMIT_WINDOWS:
        return len(kill_in_commit_window(nodes, point, system.db_url, system.logs))
    return died_there(nodes, point, system)


def crash_round(system: System, point: str, width: int) -> tuple[int, Tally]:
    """One round: `width` processes die at `point`, a replacement takes over; returns the
    kills and what the invariant checker found after the drain."""
    role = ROLE_OF[point]
    action = "stop" if point in COMMIT_WINDOWS else "exit"
    if role == "intake":
        batches = [system.new_ids("m", 2) for _ in range(width)]
        nodes = [system.submit(ids, failpoint=point, action=action) for ids in batches]
        kills = killed_there(nodes, point, system)
        # The client never saw an ACK, so it sends the same envelopes again.
        every_id = [m for ids in batches for m in ids]
        assert system.submit(every_id).wait(DIE_WITHIN) == 0, system.logs()
        system.acknowledge(every_id)
        return kills, system.drain()
    # The work is there before the failing processes start, so each finds some
    # (a claim failpoint is reached only by a claim that leased something). Twice as
    # much as there are processes: a relay may hold two batches when it dies.
    system.intake(2 * width)
    system.publish(1)
    nodes = [system.start(role, failpoint=point, action=action) for _ in range(width)]
    kills = killed_there(nodes, point, system)
    replacement = system.start(role)
    found = system.drain()
    replacement.stop()
    return kills, found


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mysql"], indirect=True)
@pytest.mark.parametrize("point", sorted(ROLE_OF))
def test_a_process_killed_at_each_failpoint_loses_nothing(
    point: str, backend: str, db_url: str, tmp_path: Path, soak: bool
) -> None:
    """RUNS kills per point and backend (SOAK_RUNS with --soak); invariants hold after each."""
    role = ROLE_OF[point]
    width = 1 if role == "receiver" else WIDTH
    runs = SOAK_RUNS if soak else RUNS
    kills = 0
    with System(tmp_path, db_url) as system:
        others = [r for r in ("receiver", "worker", "relay") if r != role]
        running = {r: system.start(r) for r in others}
        for _ in range(runs // width):
            killed, found = crash_round(system, point, width)
            kills += killed
            if found.broken():
                break  # recorded as found, then failed
        else:
            found = system.drain()
        record_then_assert(
            "crash matrix",
            backend,
            point,
            runs=runs,
            kills=kills,
            messages=found.messages,
            found=found,
        )
        assert all(node.alive for node in running.values()), system.logs()
    assert kills == runs
