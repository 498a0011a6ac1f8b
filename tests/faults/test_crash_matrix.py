"""Crash matrix: a real process dies at every failpoint, then recovers.

The failpoints: docs/explanation/contract.md#failure-windows-and-guarantees.

For each point, rounds of `WIDTH` processes of the role under test start with
OUTBOX_FAILPOINT set and each dies there (exit 86, os._exit: no cleanup), while
the other roles run normally. A replacement starts without the failpoint and
the system drains; the invariant checker then finds nothing lost, duplicated,
stuck or unexpected, and no reply dead. The receiver listens on one port, so
its points run one process per round.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.figures import record
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


def crash_round(system: System, point: str, width: int) -> int:
    """One round: `width` processes die at `point`, a replacement takes over; returns kills."""
    role = ROLE_OF[point]
    if role == "intake":
        batches = [system.new_ids("m", 2) for _ in range(width)]
        kills = died_there([system.submit(ids, failpoint=point) for ids in batches], point, system)
        # The client never saw an ACK, so it sends the same envelopes again.
        every_id = [m for ids in batches for m in ids]
        assert system.submit(every_id).wait(DIE_WITHIN) == 0, system.logs()
        system.acknowledge(every_id)
        return kills
    # The work is there before the failing processes start, so each finds some
    # (claim failpoints are reached by empty claims too). Twice as much as
    # there are processes: a relay may hold two batches when it dies.
    system.intake(2 * width)
    system.publish(1)
    kills = died_there([system.start(role, failpoint=point) for _ in range(width)], point, system)
    replacement = system.start(role)
    system.drain().assert_clean()
    replacement.stop()
    return kills


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
            kills += crash_round(system, point, width)
            if role == "intake":
                system.drain().assert_clean()
        found = system.drain()
        found.assert_clean()
        assert all(node.alive for node in running.values()), system.logs()
    assert kills == runs
    record(
        "crash matrix", backend, point, runs=runs, kills=kills, messages=found.messages, found=found
    )
