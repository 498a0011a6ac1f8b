"""Stale leases: a process paused right after claiming cannot write over its successor.

A worker (stopped at `claim.after_commit`) or a relay (at `relay.after_claim`)
stops itself with SIGSTOP, holding a lease. After the lease expires a healthy
process takes the work over under a higher fence and finishes it. Then the
paused one resumes with SIGCONT: its write is refused, the row keeps the
successor's owner and fence, fences never decrease, and each reply has one
effect. Twenty times per role and backend, in rounds of `WIDTH` paused processes.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.receiver_helpers import wait_until

from faults.figures import record_then_assert
from faults.nodes import Node
from faults.system import System

REPEATS = 20
WIDTH = 5
PAUSE_AT = {"worker": "claim.after_commit", "relay": "relay.after_claim"}
TABLE = {"worker": "tasks", "relay": "messages"}
FINISHED = {"worker": "done", "relay": "sent"}
# What each role logs when its late write is refused.
REFUSED = {"worker": "discarded", "relay": "taken over"}
WAIT = 30.0


def held_by(system: System, role: str, names: set[str]) -> dict[str, int]:
    """The rows the paused processes hold: key -> fence (asserts one row each)."""
    leases = system.leases(TABLE[role])
    held = {key: fence for key, (_, owner, fence) in leases.items() if owner in names}
    owners = {leases[key][1] for key in held}
    assert owners == names, (leases, names)
    assert len(held) == len(names), (leases, names)
    return held


def pending(system: System) -> int:
    """How many replies wait to be claimed."""
    return sum(state == "pending" for state, _, _ in system.leases("messages").values())


def stale_round(system: System, role: str) -> None:
    """WIDTH processes pause holding a lease each; a successor finishes; they resume, refused."""
    system.intake(WIDTH)
    if role == "relay":
        wait_until(lambda: pending(system) >= WIDTH, WAIT, "the worker to write the replies")
    paused = [system.start(role, PAUSE_AT[role], action="stop") for _ in range(WIDTH)]
    wait_until(lambda: all(n.paused for n in paused), WAIT, "every process to pause")
    stale = held_by(system, role, {n.name for n in paused})
    successor = system.start(role)

    def taken_over() -> bool:
        leases = system.leases(TABLE[role])
        return all(leases[key][0] == FINISHED[role] for key in stale)

    wait_until(taken_over, WAIT, "the successor to finish the paused processes' work")
    before = system.leases(TABLE[role])
    for key, fence in stale.items():
        _, owner, newer = before[key]
        assert owner == successor.name, (key, before[key])
        assert newer > fence, (key, before[key], fence)
    for node in paused:
        node.signal(signal.SIGCONT)
    wait_until(lambda: all(refused(n) for n in paused), WAIT, "the resumed writes to be refused")
    after = system.leases(TABLE[role])
    for key in stale:
        assert after[key] == before[key], (key, before[key], after[key])
    assert all(after[k][2] >= before[k][2] for k in before), "a fence went down"
    for node in [*paused, successor]:
        assert node.stop() == 0, system.logs()


def refused(node: Node) -> bool:
    """Whether the resumed process has logged its refused write."""
    role = node.name.split("-")[0]
    return REFUSED[role] in node.tail(200)


@pytest.mark.parametrize("role", ["worker", "relay"])
def test_a_resumed_stale_process_cannot_write(
    role: str, backend: str, db_url: str, tmp_path: Path
) -> None:
    """REPEATS paused processes per role and backend; all refused, nothing lost or doubled."""
    with System(tmp_path, db_url) as system:
        others = [system.start(r) for r in ("receiver", "worker", "relay") if r != role]
        for _ in range(REPEATS // WIDTH):
            stale_round(system, role)
        found = system.drain()
        record_then_assert(
            "stale lease",
            backend,
            role,
            runs=REPEATS,
            kills=REPEATS,
            messages=found.messages,
            found=found,
        )
        assert all(node.alive for node in others), system.logs()
