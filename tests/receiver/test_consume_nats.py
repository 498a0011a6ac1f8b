"""The JetStream consumer against the local nats-server: dedupe, refusals, retries, order."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import nats
import pytest
from nats.js.api import ConsumerInfo
from sqlalchemy.orm import Session
from support.broker_messages import Stream, consumed, outbox_headers, until
from support.db_faults import database_down
from support.keyed_consumers import (
    KeyedBroker,
    a_failing_message_holds_back_its_key_alone,
    a_message_that_always_fails_goes_dead,
    running,
)
from support.receiver_helpers import (
    OTHER_SECRET,
    SECRET,
    count_effects,
    stored_receipts,
)

import outbox
from outbox.signing import ORDERING_KEY_HEADER
from receiver import NatsConsumer, ReceiptStore
from receiver.effects import REPLY_ID_KEY, record_effect

WAIT = 30.0


def body_of(reply_id: str) -> bytes:
    """A canonical JSON body naming its message."""
    return json.dumps({"reply": reply_id}, separators=(",", ":"), sort_keys=True).encode()


async def publish(
    stream: Stream,
    reply_id: str,
    body: bytes | None = None,
    *,
    key: str = "k",
    secret: str | None = SECRET,
    spoil: Callable[[dict[str, str]], None] | None = None,
    timestamp: float | None = None,
) -> None:
    """Publish one message as the relay would (spoil: change its headers first)."""
    body = body_of(reply_id) if body is None else body
    headers = outbox_headers(reply_id, body, secret, timestamp=timestamp)
    headers["Nats-Msg-Id"] = reply_id
    if spoil is not None:
        spoil(headers)
    client = await nats.connect(stream.url)
    try:
        await client.jetstream().publish(f"{stream.prefix}.{key}", body, headers=headers)
    finally:
        await client.close()


async def consumer_state(stream: Stream) -> ConsumerInfo:
    """The durable consumer as JetStream sees it."""
    client = await nats.connect(stream.url)
    try:
        return await client.jetstream().consumer_info(stream.name, stream.durable)
    finally:
        await client.close()


async def settled(stream: Stream) -> bool:
    """Nothing waits for delivery and nothing delivered waits for an ack."""
    info = await consumer_state(stream)
    return info.num_pending == 0 and info.num_ack_pending == 0


def nats_consumer(store: ReceiptStore, stream: Stream, **options: Any) -> NatsConsumer:
    """A consumer of the test's stream with the reference effect."""
    options.setdefault("secrets", [SECRET])
    options.setdefault("effect", record_effect)
    return NatsConsumer(
        store, url=stream.url, stream=stream.name, durable=stream.durable, **options
    )


def test_messages_are_stored_once_and_acknowledged(db_url: str, nats_stream: Stream) -> None:
    store = ReceiptStore(db_url)
    store.accept("held", body_of("held"), record_effect)  # came before, over HTTP say
    day_old = time.time() - 86_400

    async def scenario() -> None:
        await publish(nats_stream, "fresh")
        await publish(nats_stream, "held")
        # A consumer down for a day still takes what waited for it: no freshness limit.
        await publish(nats_stream, "old", timestamp=day_old)
        consumer = nats_consumer(store, nats_stream)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == 2 and await settled(nats_stream)

            await until(done, WAIT, "two stored, everything acknowledged")
        assert consumed(consumer.metrics, "duplicate") == 1
        assert (await consumer_state(nats_stream)).num_redelivered == 0

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    assert sorted(stored_receipts(db_url)) == ["fresh", "held", "old"]
    for reply_id in ("fresh", "held", "old"):
        assert count_effects(db_url, reply_id) == 1


def test_the_same_id_with_another_body_is_acknowledged_as_a_conflict(
    db_url: str, nats_stream: Stream, caplog: pytest.LogCaptureFixture
) -> None:
    store = ReceiptStore(db_url)
    store.accept("taken", body_of("first"), record_effect)

    async def scenario() -> None:
        await publish(nats_stream, "taken", body_of("second"))
        consumer = nats_consumer(store, nats_stream)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "conflict") == 1 and await settled(nats_stream)

            await until(done, WAIT, "the conflict acknowledged")
        assert (await consumer_state(nats_stream)).num_redelivered == 0

    with caplog.at_level(logging.ERROR, "outbox.receiver.consume"):
        try:
            asyncio.run(scenario())
        finally:
            store.close()
    assert stored_receipts(db_url) == {"taken": body_of("first")}
    assert count_effects(db_url, "taken") == 1
    assert any("taken" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def _wrong_hash(headers: dict[str, str]) -> None:
    headers["outbox-content-hash"] = "0" * 64


def _no_id(headers: dict[str, str]) -> None:
    del headers["webhook-id"]


def _other_msg_id(headers: dict[str, str]) -> None:
    headers["Nats-Msg-Id"] = "someone-else"


def test_bad_messages_are_refused_not_stored_and_not_redelivered(
    db_url: str, nats_stream: Stream, caplog: pytest.LogCaptureFixture
) -> None:
    store = ReceiptStore(db_url)

    async def scenario() -> None:
        await publish(nats_stream, "forged", secret=OTHER_SECRET)
        await publish(nats_stream, "unsigned", secret=None)
        await publish(nats_stream, "altered", spoil=_wrong_hash)
        await publish(nats_stream, "anonymous", spoil=_no_id)
        await publish(nats_stream, "renamed", spoil=_other_msg_id)
        await publish(nats_stream, "not-json", b"{not json")
        consumer = nats_consumer(store, nats_stream)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "invalid") == 6 and await settled(nats_stream)

            await until(done, WAIT, "six refusals settled")
        assert consumed(consumer.metrics, "stored") == 0
        assert (await consumer_state(nats_stream)).num_redelivered == 0

    with caplog.at_level(logging.ERROR, "outbox.receiver.consume"):
        try:
            asyncio.run(scenario())
        finally:
            store.close()
    assert stored_receipts(db_url) == {}
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 6
    assert any("signature" in text for text in refusals)
    assert any("SHA-256" in text for text in refusals)


def test_an_unsigned_consumer_takes_unsigned_messages(db_url: str, nats_stream: Stream) -> None:
    store = ReceiptStore(db_url)

    async def scenario() -> None:
        await publish(nats_stream, "plain", secret=None)
        consumer = nats_consumer(store, nats_stream, secrets=None, unsigned=True)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == 1 and await settled(nats_stream)

            await until(done, WAIT, "the unsigned message stored")

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    assert count_effects(db_url, "plain") == 1


def test_a_database_that_refuses_leaves_messages_unacknowledged_until_it_is_back(
    db_url: str, nats_stream: Stream
) -> None:
    engine = outbox.create_engine(db_url)
    store = ReceiptStore(engine)
    ids = [f"m{i}" for i in range(3)]

    async def scenario() -> None:
        for reply_id in ids:
            await publish(nats_stream, reply_id)
        # Dead on the first failure of an effect: a database outage must not count as one.
        consumer = nats_consumer(
            store, nats_stream, backoff=0.05, backoff_cap=0.2, max_deliveries=1
        )
        async with running(consumer):
            with database_down(engine):

                async def redelivered() -> bool:
                    if consumed(consumer.metrics, "retry") < 6:
                        return False  # (until then the durable may not exist yet)
                    return (await consumer_state(nats_stream)).num_redelivered >= 3

                await until(redelivered, WAIT, "the messages delivered again")
                assert consumed(consumer.metrics, "stored") == 0

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == 3 and await settled(nats_stream)

            await until(done, WAIT, "the messages stored once the database is back")
            assert consumed(consumer.metrics, "dead") == 0

    try:
        asyncio.run(scenario())
    finally:
        store.close()
        engine.dispose()
    for reply_id in ids:
        assert count_effects(db_url, reply_id) == 1


@pytest.mark.parametrize("backend", ["postgresql"])
def test_one_consumer_applies_each_keys_messages_in_stream_order(
    db_url: str, nats_stream: Stream
) -> None:
    keys, per_key = 50, 20
    applied: list[str] = []

    def remember(session: Session, body: bytes) -> None:
        applied.append(session.info[REPLY_ID_KEY])

    store = ReceiptStore(db_url)

    async def scenario() -> None:
        client = await nats.connect(nats_stream.url)
        try:
            jetstream = client.jetstream()
            # Interleaved keys, each key's messages in order: what the relay's claim gives.
            for n in range(per_key):
                for k in range(keys):
                    reply_id = f"key{k}-{n:02d}"
                    body = body_of(reply_id)
                    headers = outbox_headers(reply_id, body, SECRET)
                    headers["Nats-Msg-Id"] = reply_id
                    await jetstream.publish(f"{nats_stream.prefix}.key{k}", body, headers=headers)
        finally:
            await client.close()
        consumer = nats_consumer(store, nats_stream, effect=remember, batch=64)
        async with running(consumer):

            async def done() -> bool:
                total = keys * per_key
                return consumed(consumer.metrics, "stored") == total and await settled(nats_stream)

            await until(done, 60.0, "every message stored")

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    assert len(applied) == keys * per_key == len(set(applied))
    for k in range(keys):
        mine = [reply_id for reply_id in applied if reply_id.startswith(f"key{k}-")]
        assert mine == sorted(mine), f"key{k} applied out of order"


def keyed(stream: Stream) -> KeyedBroker:
    """The test's stream for the keyed scenarios (support.keyed_consumers)."""

    async def send(reply_id: str, key: str | None) -> None:
        def with_key(headers: dict[str, str]) -> None:
            if key is not None:
                headers[ORDERING_KEY_HEADER] = key

        await publish(stream, reply_id, key=key or "_", spoil=with_key)

    return KeyedBroker(
        send,
        lambda store, **options: nats_consumer(store, stream, **options),
        lambda: settled(stream),
    )


def test_a_failing_message_holds_back_its_key_alone_until_it_passes(
    db_url: str, nats_stream: Stream
) -> None:
    a_failing_message_holds_back_its_key_alone(keyed(nats_stream), db_url)


def test_a_message_whose_effect_always_raises_goes_dead_and_its_key_goes_on(
    db_url: str, nats_stream: Stream
) -> None:
    async def nothing_left() -> None:
        state = await consumer_state(nats_stream)
        assert (state.num_pending, state.num_ack_pending) == (0, 0)

    letter = a_message_that_always_fails_goes_dead(keyed(nats_stream), db_url, nothing_left)
    # JetStream's own count: the 3 failures, and any delivery held within a backoff.
    assert letter["deliveries"] >= 3
    assert letter["broker"] == "nats"
    assert letter["broker_ref"] == f"{nats_stream.name}/1"
