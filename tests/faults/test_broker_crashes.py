"""Relays SIGKILLed at each relay failpoint, 10 times per broker: each reply applied once.

For NATS JetStream and RabbitMQ and each relay failpoint, relay processes start
one after another with the failpoint armed, and each dies there (os._exit: no
cleanup, like a kill) in the middle of one drain; a clean relay then finishes it.
At `relay.before_sent_commit` each stops there instead and is SIGKILLed once the
database is seen holding its uncommitted outcomes, which are then seen rolled
back (faults.commit_window).
At `relay.after_remote_commit` and `relay.before_sent_commit` the dead relay had
its broker's ACKs and never recorded them, so the messages are published again
once their lease expires. A real `outbox receiver consume` process applies the
reference effect throughout. The invariant checker then finds nothing lost,
duplicated, stuck or unexpected; JetStream holds each reply_id exactly once (its
duplicate window drops the resends); RabbitMQ may have queued a reply twice (the
duplicates are counted) and the consumer's dedupe applied it once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.relay_helpers import publish_many

import outbox
from faults.brokers import Deployment, broker
from faults.commit_window import POINTS as COMMIT_WINDOWS
from faults.commit_window import kill_in_commit_window
from faults.figures import record_then_assert
from outbox import failpoints
from outbox.schema import messages

pytestmark = [
    pytest.mark.postgresql_only,
    pytest.mark.parametrize("backend", ["postgresql"], indirect=True),
]

RELAY_POINTS = sorted(p for p in failpoints.POINTS if p.startswith("relay."))
RESENDING_POINTS = {"relay.after_remote_commit", "relay.before_sent_commit"}
"""Points where the dead relay had the broker's ACKs and recorded nothing: a resend follows."""
KILLS = 10
SOAK_KILLS = 100
BATCH = 2
# A relay may hold three batches of one destination when it dies (relay/pipeline.py): the
# last killed one still finds work even when every one before it had sent all of its own.
HELD_PER_KILL = 3 * BATCH
DIE_WITHIN = 30.0


def most_attempts(db_url: str) -> int:
    """The largest attempt count of any reply: above 1 when some reply was published again."""
    engine = outbox.create_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.max(messages.c.attempts))).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.parametrize("point", RELAY_POINTS)
@pytest.mark.parametrize("kind", ["nats", "rabbitmq"])
def test_relays_killed_at_a_failpoint_deliver_each_reply_once(
    kind: str, point: str, db_url: str, tmp_path: Path, soak: bool
) -> None:
    """KILLS relays die at `point` (SOAK_KILLS with --soak); then the invariants hold."""
    kills = SOAK_KILLS if soak else KILLS
    total = kills * HELD_PER_KILL + 4
    ids = [f"{kind}-{n}" for n in range(total)]
    engine = outbox.create_engine(db_url)
    publish_many(engine, ids)
    engine.dispose()
    with broker(kind) as place, Deployment(tmp_path, db_url, place, batch=BATCH) as deployment:
        consumer = deployment.consumer()
        for _ in range(kills):
            if point in COMMIT_WINDOWS:
                stopped = deployment.relay(failpoint=point, action="stop")
                kill_in_commit_window([stopped], point, db_url, deployment.logs)
                continue
            killed = deployment.relay(failpoint=point)
            killed.wait(DIE_WITHIN)
            assert killed.died_at_failpoint(), (
                f"{killed.name} did not die at {point} (exit {killed.exitcode})\n"
                f"{deployment.logs()}"
            )
        deployment.relay()
        found = deployment.drain(ids)
        record_then_assert(
            "broker crash",
            "postgresql",
            f"{kind} {point}",
            runs=kills,
            kills=kills,
            messages=total,
            found=found,
        )
        duplicates = deployment.consumed("duplicate")
        assert deployment.consumed("stored") == total
        assert consumer.stop() == 0, deployment.logs()
        if place.stream is not None:
            held = Counter(m.headers["webhook-id"] for m in place.stream.stored())
            assert held == Counter(ids), f"the stream holds {held}"
        if point in RESENDING_POINTS:
            assert most_attempts(db_url) > 1, "no reply was published again"
            if kind == "rabbitmq":
                assert duplicates >= 1, "no resend reached the queue"
    print(f"{kind} {point}: {kills} kills, {total} replies, {duplicates} duplicates consumed")
