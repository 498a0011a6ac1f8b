"""Soak: tasks flow through 3 workers and 3 relays while a chaos loop kills processes.

Every 0.5-2 s the loop SIGKILLs a random worker, relay or the receiver and
starts a replacement. Work keeps arriving meanwhile, with published replies that
carry ordering keys, half of them one hot key (faults.system.ordering_key). When
the feed is done the chaos stops, and after the drain every invariant is 0, no
keyed reply applied out of its key's order included. The short form runs in
CI (2,000 tasks on PostgreSQL; 200 on SQLite, where six processes share one
file's write lock); `pytest tests/faults/test_soak.py --soak` runs the long one
(10,000 on PostgreSQL). Set OUTBOXDEV_SOAK_SEED to replay a run's choices.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from faults.figures import record_then_assert
from faults.nodes import Node
from faults.system import System

MESSAGES = {"postgresql": 2_000, "mysql": 1_000, "sqlite": 200}
SOAK_MESSAGES = {"postgresql": 10_000, "mysql": 10_000, "sqlite": 5_000}
FEED_CHUNK = 50
PUBLISH_EVERY = 4  # one published reply per this many tasks, keyed (half the hot key)
KILL_EVERY = (0.5, 2.0)
ROLES = ("worker", "relay")
REPLICAS = 3
CHAOS_UNTIL_SENT = 0.9
CHAOS_DEADLINE = {False: 300.0, True: 3000.0}
"""Seconds the chaos may last in the short form and in the --soak form: several times what
a busy machine takes. A flow that stops making progress fails the test with its seed."""


def feed(system: System, total: int, done: threading.Event, errors: list[BaseException]) -> None:
    """Intake `total` tasks in chunks (plus published replies), then set `done`."""
    try:
        sent = 0
        while sent < total:
            chunk = min(FEED_CHUNK, total - sent)
            system.intake(chunk)
            system.publish(max(1, chunk // PUBLISH_EVERY))
            sent += chunk
    except BaseException as exc:
        errors.append(exc)
    finally:
        done.set()


def chaos(
    system: System, running: list[Node], rng: random.Random, fed: threading.Event, seconds: float
) -> int:
    """Kill a random process every 0.5-2 s, start its replacement; returns the kills.

    The chaos lasts until the feed is done and most of the replies are sent, so
    the kills hit every stage of the flow, the last replies included; it fails once
    `seconds` have passed without that.
    """
    kills = 0
    deadline = time.monotonic() + seconds
    while not (fed.is_set() and system.sent_fraction() >= CHAOS_UNTIL_SENT):
        assert time.monotonic() < deadline, (
            f"the chaos ran {seconds:g}s: fed {fed.is_set()}, sent {system.sent_fraction():.0%}"
        )
        time.sleep(rng.uniform(*KILL_EVERY))  # pacing the chaos, not waiting for a result
        victim = rng.choice(running)
        victim.kill()
        kills += 1
        role = victim.name.split("-")[0]
        running[running.index(victim)] = system.start(role)
    return kills


@pytest.mark.timeout(2 * CHAOS_DEADLINE[True])  # the --soak form outlasts the default
def test_chaos_kills_lose_and_double_nothing(
    backend: str, db_url: str, tmp_path: Path, soak: bool
) -> None:
    """MESSAGES tasks under random SIGKILLs; all invariants 0 after the drain."""
    total = (SOAK_MESSAGES if soak else MESSAGES)[backend]
    seed = int(os.environ.get("OUTBOXDEV_SOAK_SEED") or time.time_ns() % 2**32)
    rng = random.Random(seed)
    print(f"OUTBOXDEV_SOAK_SEED={seed}")
    with System(
        tmp_path, db_url, lease=2.0, relay_batch=100, relay_mode="batch", worker_concurrency=4
    ) as system:
        running = [system.start("receiver")]
        running += [system.start(role) for role in ROLES for _ in range(REPLICAS)]
        fed = threading.Event()
        errors: list[BaseException] = []
        feeder = threading.Thread(target=feed, args=(system, total, fed, errors), daemon=True)
        feeder.start()
        kills = chaos(system, running, rng, fed, CHAOS_DEADLINE[soak])
        feeder.join(timeout=CHAOS_DEADLINE[soak])
        assert not feeder.is_alive(), f"seed {seed}: the feed never ended"
        assert not errors, errors
        found = system.drain(timeout=120)
        assert all(node.alive for node in running), f"seed {seed}\n{system.logs()}"
    record_then_assert(
        "soak",
        backend,
        f"{REPLICAS} workers, {REPLICAS} relays, receiver",
        runs=1,
        kills=kills,
        messages=found.messages,
        found=found,
    )
    assert found.tasks == total, (found, seed)
    assert found.keyed == len(system.published) > 0, (found, seed)
    assert kills > 0, f"seed {seed}: the feed ended before the first kill"
