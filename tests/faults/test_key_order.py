"""Per-key order under crashes, with a hot key carrying half the messages.

Every message is published with an ordering key (faults.system.ordering_key: every
other one the hot key, the rest over 8 cold keys), each in its own transaction, so
the publish order is the id order within each key. Then processes die where a
message's effect is committed and its outcome not yet recorded:

- relays in batch mode with `ordered_batches` (a key's messages travel together)
  killed mid-batch at each relay failpoint (after the claim, after the receiver
  committed the batch, inside the commit of its outcomes, after it), 5 in turn, then
  a clean relay finishes;
- the HTTP receiver killed after its commit (`receiver.after_commit`: the lost ACK),
  5 in turn, the relay sending the same batch again to the next one;
- a broker consumer killed after its commit and before its ack
  (`receiver.consume.before_ack`), 5 in turn behind JetStream and RabbitMQ, each
  broker delivering the committed messages again to the next one.

The invariant checker then reads the effects in the order the receiver applied
them (their identity column) and finds, besides nothing lost, duplicated, stuck
or unexpected, no keyed message applied after a later message of its key; the
figures are recorded before they are asserted (faults.figures).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session
from support.receiver_helpers import wait_until

import outbox
from faults import invariants
from faults.brokers import Deployment, broker
from faults.commit_window import POINTS as COMMIT_WINDOWS
from faults.figures import record_then_assert
from faults.system import System, ordering_key
from faults.test_crash_matrix import DIE_WITHIN, died_there, killed_there
from outbox import failpoints
from receiver.consume import BEFORE_ACK

RELAY_POINTS = sorted(p for p in failpoints.POINTS if p.startswith("relay."))
KILLS = 5
BATCH = 8
MESSAGES = 60
"""More than KILLS batches: each killed relay finds work, whatever one claim may take."""
PER_ROUND = 8
"""Messages published before each consumer is started to die."""


@pytest.mark.parametrize("point", RELAY_POINTS)
def test_relays_killed_mid_batch_keep_each_keys_order(
    point: str, backend: str, db_url: str, tmp_path: Path
) -> None:
    action = "stop" if point in COMMIT_WINDOWS else "exit"
    with System(
        tmp_path, db_url, relay_batch=BATCH, relay_mode="batch", ordered_batches=True
    ) as system:
        system.start("receiver")
        system.publish(MESSAGES)
        kills = 0
        for _ in range(KILLS):
            relay = system.start("relay", failpoint=point, action=action)
            kills += killed_there([relay], point, system)
        system.start("relay")
        found = system.drain()
        record_then_assert(
            "key order",
            backend,
            f"relays killed mid-batch at {point}",
            runs=KILLS,
            kills=kills,
            messages=found.messages,
            found=found,
        )
    assert found.keyed == MESSAGES


def test_receivers_killed_after_their_commit_keep_each_keys_order(
    backend: str, db_url: str, tmp_path: Path
) -> None:
    point = "receiver.after_commit"
    with System(
        tmp_path, db_url, relay_batch=BATCH, relay_mode="batch", ordered_batches=True
    ) as system:
        system.publish(MESSAGES)
        system.start("relay")
        kills = 0
        for _ in range(KILLS):
            receiver = system.start("receiver", failpoint=point)
            kills += died_there([receiver], point, system)
        system.start("receiver")
        found = system.drain()
        record_then_assert(
            "key order",
            backend,
            f"HTTP receivers killed at {point}",
            runs=KILLS,
            kills=kills,
            messages=found.messages,
            found=found,
        )
    assert found.keyed == MESSAGES


def publish_keyed(db_url: str, first: int, count: int) -> list[str]:
    """Publish `count` replies numbered from `first`, keyed as System.publish keys them."""
    engine = outbox.create_engine(db_url)
    ids = []
    try:
        for n in range(first, first + count):
            reply_id = f"k-{n}"
            with Session(engine) as session, session.begin():
                outbox.publish(session, "default", reply_id, {"n": n}, ordering_key=ordering_key(n))
            ids.append(reply_id)
    finally:
        engine.dispose()
    return ids


@pytest.mark.postgresql_only
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("kind", ["nats", "rabbitmq"])
def test_consumers_killed_after_their_commit_keep_each_keys_order(
    kind: str, db_url: str, tmp_path: Path
) -> None:
    # JetStream gives an unacknowledged message again after ack_wait: 1 s, so the
    # killed consumers' messages come again within the test.
    options = ["--ack-wait", "1"] if kind == "nats" else []
    ids: list[str] = []
    with broker(kind) as place, Deployment(tmp_path, db_url, place, batch=BATCH) as deployment:
        deployment.relay()
        kills = 0
        for _ in range(KILLS):
            # New messages each round, so each consumer commits some before it dies.
            ids += publish_keyed(db_url, len(ids), PER_ROUND)
            consumer = deployment.consumer(failpoint=BEFORE_ACK, options=options)
            consumer.wait(DIE_WITHIN)
            assert consumer.died_at_failpoint(), (
                f"{consumer.name} did not die at {BEFORE_ACK} (exit {consumer.exitcode})\n"
                f"{deployment.logs()}"
            )
            kills += 1
        consumer = deployment.consumer(options=options)
        deployment.drain(ids, timeout=120)
        # What the killed consumers committed and never acknowledged comes again, and is
        # found a duplicate: it must not apply a second effect, nor one out of order.
        wait_until(lambda: deployment.consumed("duplicate") >= 1, 60, "a redelivery")
        found = invariants.tally(db_url, published=ids)
        record_then_assert(
            "key order",
            "postgresql",
            f"{kind} consumers killed at {BEFORE_ACK}",
            runs=KILLS,
            kills=kills,
            messages=found.messages,
            found=found,
        )
        assert consumer.stop() == 0, deployment.logs()
    assert found.keyed == len(ids) == KILLS * PER_ROUND
