"""The RabbitMQ consumer against the local server: dedupe, refusals, retries."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import aio_pika
import pytest
from faults.stream_proxy import StreamProxy
from sqlalchemy.orm import Session
from support.broker_messages import AMQP_URL, consumed, outbox_headers, queue_waiting, until
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
from receiver import RabbitMQConsumer, ReceiptStore
from receiver.effects import Effect, record_effect, record_effects

WAIT = 30.0


def body_of(reply_id: str) -> bytes:
    """A canonical JSON body naming its message."""
    return json.dumps({"reply": reply_id}, separators=(",", ":"), sort_keys=True).encode()


async def publish(
    queue: str,
    reply_id: str,
    body: bytes | None = None,
    *,
    secret: str | None = SECRET,
    spoil: Callable[[dict[str, Any]], None] | None = None,
    timestamp: float | None = None,
    message_id: str | None = None,
) -> None:
    """Publish one persistent message as the relay would, straight to `queue`."""
    body = body_of(reply_id) if body is None else body
    headers: dict[str, Any] = dict(outbox_headers(reply_id, body, secret, timestamp=timestamp))
    if spoil is not None:
        spoil(headers)
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        message = aio_pika.Message(
            body,
            headers=headers,
            message_id=message_id or reply_id,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await channel.default_exchange.publish(message, routing_key=queue)
    finally:
        await connection.close()


def rabbit_consumer(store: ReceiptStore, queue: str, **options: Any) -> RabbitMQConsumer:
    """A consumer of the test's queue with the reference effect."""
    options.setdefault("secrets", [SECRET])
    options.setdefault("effect", record_effect)
    return RabbitMQConsumer(store, url=AMQP_URL, queue=queue, **options)


def test_messages_are_stored_once_and_a_second_copy_is_a_duplicate(
    db_url: str, rabbit_queue: str
) -> None:
    store = ReceiptStore(db_url)
    day_old = time.time() - 86_400

    async def scenario() -> None:
        await publish(rabbit_queue, "fresh")
        await publish(rabbit_queue, "fresh")  # the relay published it twice
        await publish(rabbit_queue, "old", timestamp=day_old)
        consumer = rabbit_consumer(store, rabbit_queue)
        async with running(consumer):

            async def done() -> bool:
                counted = consumed(consumer.metrics, "stored") + consumed(
                    consumer.metrics, "duplicate"
                )
                return counted == 3

            await until(done, WAIT, "three messages consumed")
        assert consumed(consumer.metrics, "stored") == 2
        assert consumed(consumer.metrics, "duplicate") == 1
        assert await queue_waiting(rabbit_queue) == 0  # all acknowledged: nothing came back

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    assert sorted(stored_receipts(db_url)) == ["fresh", "old"]
    assert count_effects(db_url, "fresh") == count_effects(db_url, "old") == 1


def test_the_same_id_with_another_body_is_acknowledged_as_a_conflict(
    db_url: str, rabbit_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = ReceiptStore(db_url)

    async def scenario() -> None:
        await publish(rabbit_queue, "taken", body_of("first"))
        await publish(rabbit_queue, "taken", body_of("second"))
        consumer = rabbit_consumer(store, rabbit_queue)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "conflict") == 1

            await until(done, WAIT, "the conflict")
        assert consumed(consumer.metrics, "stored") == 1
        assert await queue_waiting(rabbit_queue) == 0

    with caplog.at_level(logging.ERROR, "outbox.receiver.consume"):
        try:
            asyncio.run(scenario())
        finally:
            store.close()
    assert stored_receipts(db_url) == {"taken": body_of("first")}
    assert count_effects(db_url, "taken") == 1
    assert any("taken" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def _wrong_hash(headers: dict[str, Any]) -> None:
    headers["outbox-content-hash"] = "0" * 64


def _binary_id(headers: dict[str, Any]) -> None:
    headers["webhook-id"] = 7


def test_bad_messages_are_rejected_without_requeue(
    db_url: str, rabbit_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = ReceiptStore(db_url)

    async def scenario() -> None:
        await publish(rabbit_queue, "forged", secret=OTHER_SECRET)
        await publish(rabbit_queue, "unsigned", secret=None)
        await publish(rabbit_queue, "altered", spoil=_wrong_hash)
        await publish(rabbit_queue, "numbered", spoil=_binary_id)
        await publish(rabbit_queue, "renamed", message_id="someone-else")
        consumer = rabbit_consumer(store, rabbit_queue)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "invalid") == 5

            await until(done, WAIT, "five refusals")
        assert consumed(consumer.metrics, "stored") == 0
        assert await queue_waiting(rabbit_queue) == 0  # rejected, not requeued

    with caplog.at_level(logging.ERROR, "outbox.receiver.consume"):
        try:
            asyncio.run(scenario())
        finally:
            store.close()
    assert stored_receipts(db_url) == {}
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 5


def test_a_database_that_refuses_leaves_messages_in_the_queue_until_it_is_back(
    db_url: str, rabbit_queue: str
) -> None:
    engine = outbox.create_engine(db_url)
    store = ReceiptStore(engine)
    ids = [f"m{i}" for i in range(3)]

    async def scenario() -> None:
        for reply_id in ids:
            await publish(rabbit_queue, reply_id)
        # Dead on the first failure of an effect: a database outage must not count as one.
        consumer = rabbit_consumer(
            store, rabbit_queue, backoff=0.05, backoff_cap=0.2, max_deliveries=1
        )
        async with running(consumer):
            with database_down(engine):

                async def retried() -> bool:
                    return consumed(consumer.metrics, "retry") >= 6  # delivered twice, at least

                await until(retried, WAIT, "the messages delivered again")
                assert consumed(consumer.metrics, "stored") == 0

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == 3

            await until(done, WAIT, "the messages stored once the database is back")
            assert consumed(consumer.metrics, "dead") == 0
        assert await queue_waiting(rabbit_queue) == 0

    try:
        asyncio.run(scenario())
    finally:
        store.close()
        engine.dispose()
    for reply_id in ids:
        assert count_effects(db_url, reply_id) == 1


async def publish_all(queue: str, reply_ids: list[str]) -> None:
    """Publish signed messages as the relay would, on one connection, in order."""
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        for reply_id in reply_ids:
            body = body_of(reply_id)
            message = aio_pika.Message(
                body,
                headers=dict(outbox_headers(reply_id, body, SECRET)),
                message_id=reply_id,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await channel.default_exchange.publish(message, routing_key=queue)
    finally:
        await connection.close()


def cutting_after(proxy: StreamProxy, marks: set[str]) -> Effect:
    """The reference effect, which also has the proxy cut the connection right after the
    commit of a batch holding one of `marks`, as its ack goes up: consuming had started."""

    def one(session: Session, body: bytes) -> None:
        raise AssertionError("the consumer hands whole batches to an effect with many()")

    def many(session: Session, fresh: Sequence[tuple[str, float, bytes]]) -> None:
        record_effects(session, fresh)
        if marks.intersection(reply_id for reply_id, _, _ in fresh):
            proxy.cut_every(1, times=1)  # the next bytes upstream cut it

    one.many = many  # type: ignore[attr-defined]
    return one


def test_connections_lost_mid_drain_are_waited_out_and_each_message_applied_once(
    db_url: str, rabbit_queue: str
) -> None:
    store = ReceiptStore(db_url)
    ids = [f"m{i:03d}" for i in range(60)]
    marks = {"m010", "m025", "m040"}

    async def scenario() -> None:
        await publish_all(rabbit_queue, ids)
        with StreamProxy("127.0.0.1", 5672) as proxy:
            consumer = RabbitMQConsumer(
                store,
                url=f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
                queue=rabbit_queue,
                secrets=[SECRET],
                effect=cutting_after(proxy, marks),
                batch=5,
                backoff=0.05,
                backoff_cap=0.2,
            )
            task = asyncio.ensure_future(consumer.run())

            async def drained() -> bool:
                if task.done():
                    task.result()  # the consumer must not end before stop(): show why
                    raise AssertionError("the consumer ended before stop()")
                return consumed(consumer.metrics, "stored") == len(ids)

            try:
                await until(drained, WAIT, "every message stored")
            finally:
                consumer.stop()
                await asyncio.wait_for(task, WAIT)  # stops cleanly: no exception
            assert proxy.cuts == len(marks)
            assert proxy.accepted > len(marks)  # it connected again after each cut
        assert await queue_waiting(rabbit_queue) == 0

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    assert sorted(stored_receipts(db_url)) == ids
    for reply_id in ids:
        assert count_effects(db_url, reply_id) == 1


def test_a_consumer_started_before_rabbitmq_accepts_waits_for_it(
    db_url: str, rabbit_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = ReceiptStore(db_url)
    proxy = StreamProxy("127.0.0.1", 5672)
    proxy.start()
    proxy.stop()  # its port refuses connections until the proxy listens there again

    async def scenario() -> None:
        await publish(rabbit_queue, "r-1")
        consumer = RabbitMQConsumer(
            store,
            url=f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
            queue=rabbit_queue,
            secrets=[SECRET],
            effect=record_effect,
            backoff=0.05,
            backoff_cap=0.2,
        )
        task = asyncio.ensure_future(consumer.run())

        async def refused_twice() -> bool:
            if task.done():
                task.result()  # the consumer must wait, not end: show why it did
                raise AssertionError("the consumer ended while RabbitMQ refused it")
            refusals = [r for r in caplog.records if "cannot connect to RabbitMQ" in r.message]
            return len(refusals) >= 2

        try:
            with caplog.at_level(logging.WARNING, logger="outbox.receiver"):
                await until(refused_twice, WAIT, "the consumer trying RabbitMQ again")
            proxy.start()

            async def stored() -> bool:
                return consumed(consumer.metrics, "stored") == 1

            await until(stored, WAIT, "r-1 stored once RabbitMQ accepts")
        finally:
            consumer.stop()
            await asyncio.wait_for(task, WAIT)

    try:
        asyncio.run(scenario())
    finally:
        proxy.stop()
        store.close()
    assert list(stored_receipts(db_url)) == ["r-1"]


def keyed(queue: str) -> KeyedBroker:
    """The test's queue for the keyed scenarios (support.keyed_consumers)."""

    async def send(reply_id: str, key: str | None) -> None:
        def with_key(headers: dict[str, Any]) -> None:
            if key is not None:
                headers[ORDERING_KEY_HEADER] = key

        await publish(queue, reply_id, spoil=with_key)

    async def drained() -> bool:
        return await queue_waiting(queue) == 0

    return KeyedBroker(
        send, lambda store, **options: rabbit_consumer(store, queue, **options), drained
    )


def test_a_failing_message_holds_back_its_key_alone_until_it_passes(
    db_url: str, rabbit_queue: str
) -> None:
    a_failing_message_holds_back_its_key_alone(keyed(rabbit_queue), db_url)


def test_a_message_whose_effect_always_raises_goes_dead_and_its_key_goes_on(
    db_url: str, rabbit_queue: str
) -> None:
    async def nothing_left() -> None:
        # Stopped: whatever was not acknowledged would be back in the queue now.
        assert await queue_waiting(rabbit_queue) == 0

    letter = a_message_that_always_fails_goes_dead(keyed(rabbit_queue), db_url, nothing_left)
    # A classic queue keeps no delivery count: the consumer's own count of failures.
    assert (letter["deliveries"], letter["broker"]) == (None, "rabbitmq")
    assert letter["broker_ref"] == rabbit_queue
