"""A broker lost mid-drain, with a real consumer applying the effects: nothing lost, once each.

- The byte-stream proxy (faults.stream_proxy) between a relay process and each
  broker cuts every connection three times within the drain: each publish still
  waiting is a retry, the relay connects anew, and what the broker had taken before
  the cut is published again.
- A private nats-server is SIGKILLed after the stream stored some messages and
  before it stored all, then started again on the same port and store; the relay
  and the consumer both lose their connections.

An `outbox receiver consume` process reads the broker throughout. The invariant
checker then finds nothing lost, duplicated, stuck or unexpected; JetStream holds
each reply_id once, and RabbitMQ's duplicates (counted) were applied once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.nats_helpers import private_nats, with_jetstream
from support.receiver_helpers import wait_until
from support.relay_helpers import publish_many

import outbox
from faults.brokers import Broker, Deployment, broker, jetstream
from faults.figures import record_then_assert
from faults.stream_proxy import StreamProxy
from outbox.schema import messages

pytestmark = [
    pytest.mark.postgresql_only,
    pytest.mark.parametrize("backend", ["postgresql"], indirect=True),
]

CUT_TOTAL = 300
CUTS = 3
# About 600 bytes go upstream per message: three cuts well inside the drain.
CUT_EVERY = 30_000
RESTART_TOTAL = 1000


def sent_and_resent(db_url: str) -> tuple[int, int]:
    """How many replies are sent, and the largest attempt count of any reply."""
    engine = outbox.create_engine(db_url)
    try:
        with engine.connect() as conn:
            sent = conn.execute(
                sa.select(sa.func.count()).where(messages.c.state == "sent")
            ).scalar_one()
            most = conn.execute(sa.select(sa.func.max(messages.c.attempts))).scalar_one()
        return int(sent), int(most)
    finally:
        engine.dispose()


def retried(db_url: str) -> bool:
    """Whether some reply waits for another attempt after a failed one."""
    engine = outbox.create_engine(db_url)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).where(
                messages.c.state == "pending", messages.c.last_error.is_not(None)
            )
            return bool(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def assert_held_once(place: Broker, ids: list[str]) -> None:
    """JetStream: the stream holds each reply_id exactly once (nothing to check on RabbitMQ)."""
    if place.stream is not None:
        held = Counter(m.headers["webhook-id"] for m in place.stream.stored())
        assert held == Counter(ids), f"the stream holds {held - Counter(ids)} more"


@pytest.mark.parametrize("kind", ["nats", "rabbitmq"])
def test_connections_cut_between_relay_and_broker_lose_nothing_and_apply_once(
    kind: str, db_url: str, tmp_path: Path
) -> None:
    ids = [f"cut-{n}" for n in range(CUT_TOTAL)]
    engine = outbox.create_engine(db_url)
    publish_many(engine, ids)
    engine.dispose()
    with broker(kind) as place, StreamProxy(*place.address) as proxy:
        proxy.cut_every(CUT_EVERY, times=CUTS)
        settings = {"batch": 50, "max_batch_items": 25}
        with Deployment(
            tmp_path, db_url, place, relay_url=place.via(proxy.port), **settings
        ) as deployment:
            consumer = deployment.consumer()
            deployment.relay()
            found = deployment.drain(ids, timeout=90)
            record_then_assert(
                "broker outage",
                "postgresql",
                f"{kind}: connections cut",
                runs=CUTS,
                kills=proxy.cuts,
                messages=CUT_TOTAL,
                found=found,
            )
            duplicates = deployment.consumed("duplicate")
            assert deployment.consumed("stored") == CUT_TOTAL
            assert consumer.stop() == 0, deployment.logs()
        assert_held_once(place, ids)
    assert proxy.cuts == CUTS
    assert proxy.accepted >= CUTS + 1  # the first connection and one after each cut
    assert sent_and_resent(db_url)[1] > 1, "no reply was published again"
    print(f"{kind}: {CUTS} cuts, {CUT_TOTAL} replies, {duplicates} duplicates consumed")


def stored_count(place: Broker) -> int:
    """How many messages the stream holds now; -1 while the server does not answer."""
    assert place.stream is not None
    name = place.stream.name

    async def count(js: Any) -> int:
        return int((await js.stream_info(name)).state.messages)

    try:
        return with_jetstream(place.url, count)
    except Exception:  # down or restarting: not a count
        return -1


def test_a_nats_server_killed_mid_drain_with_a_consumer_applies_each_reply_once(
    db_url: str, tmp_path: Path
) -> None:
    ids = [f"restart-{n}" for n in range(RESTART_TOTAL)]
    engine = outbox.create_engine(db_url)
    publish_many(engine, ids)
    engine.dispose()
    with private_nats(tmp_path) as server, jetstream(server.url) as place:
        settings = {"batch": 50, "max_batch_items": 20}
        with Deployment(tmp_path, db_url, place, **settings) as deployment:
            consumer = deployment.consumer()
            deployment.relay()
            wait_until(lambda: stored_count(place) >= 50, 30, "the first stored messages")
            server.kill()
            assert sent_and_resent(db_url)[0] < RESTART_TOTAL, "drained before the kill"
            wait_until(lambda: retried(db_url), 30, "a retry while the server is down")
            deployment.check_running()
            server.start()
            found = deployment.drain(ids, timeout=90)
            record_then_assert(
                "broker outage",
                "postgresql",
                "nats: server killed and restarted",
                runs=1,
                kills=1,
                messages=RESTART_TOTAL,
                found=found,
            )
            assert deployment.consumed("stored") == RESTART_TOTAL
            assert consumer.stop() == 0, deployment.logs()
        assert_held_once(place, ids)
