"""Hypothesis: arbitrary header blocks and bodies into a real JetStream stream and a real
RabbitMQ queue, each in front of a running consumer, among valid signed messages.

After each example: both consumers are alive, every valid message was applied exactly
once, nothing unsigned was applied, and every message was decided once and settled
(JetStream: nothing pending or unacknowledged; RabbitMQ: the queue empty and each
refused message in its dead-letter queue).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.broker_messages import (
    AMQP_URL,
    Stream,
    consumed,
    outbox_headers,
    queue_waiting,
    unique,
    until,
)
from support.receiver_helpers import SECRET, count_effects, stored_receipts
from test_consume_nats import body_of, nats_consumer, settled
from test_consume_nats_hostile import raw_publish

from outbox.signing import broker_message_id
from receiver import RabbitMQConsumer, ReceiptStore
from receiver.consume import Consumer
from receiver.effects import record_effect

WAIT = 30.0

# Header names and values a broker carries on one line: no CR, LF or ':' in a name. Names
# starting with Nats- are left out: JetStream acts on them at publish (dedupe, expected
# stream), so such a message may never reach the stream, which is not the consumer's to see.
names = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"),
    min_size=1,
    max_size=16,
).filter(lambda n: not n.lower().startswith("nats-"))
values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24)
statuses = st.sampled_from(["", " 404", " 408 Request Timeout", " 100 Idle Heartbeat", " 503"])
junk = st.builds(
    lambda status, headers, body: ("junk", status, headers, body),
    statuses,
    st.dictionaries(
        st.one_of(st.sampled_from(["Status", "Description", "webhook-id"]), names),
        values,
        max_size=5,
    ),
    st.binary(max_size=64),
)
# A signed reply that also carries headers a client may read as a status: applied all the same.
valid = st.builds(
    lambda extra: ("valid", "", extra, b""),
    st.dictionaries(st.sampled_from(["Status", "Description", "x-a"]), values, max_size=2),
)
batches = st.lists(st.one_of(junk, valid), min_size=1, max_size=8)


@dataclass
class Running:
    """Both consumers in an event loop of their own thread, for the whole test."""

    consumers: list[Consumer]
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    tasks: list[asyncio.Future[None]] = field(default_factory=list)

    def alive(self) -> bool:
        """Whether every consumer is still running."""
        return not any(task.done() for task in self.tasks)


@contextmanager
def consuming(*consumers: Consumer) -> Iterator[Running]:
    """Run the consumers in a thread's event loop; stop and await them at the end."""
    running = Running(list(consumers))
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(running.loop)
        running.tasks = [asyncio.ensure_future(c.run(), loop=running.loop) for c in consumers]
        running.loop.call_soon(started.set)
        running.loop.run_until_complete(asyncio.gather(*running.tasks, return_exceptions=True))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(WAIT)
    try:
        yield running
    finally:
        for consumer in consumers:
            running.loop.call_soon_threadsafe(consumer.stop)
        thread.join(WAIT)
        assert not thread.is_alive(), "a consumer did not stop"
        for task in running.tasks:
            assert task.exception() is None, task.exception()
        running.loop.close()


def header_block(status: str, headers: dict[str, str]) -> bytes:
    """A NATS header block: the version line (with an inline status), then each header."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"NATS/1.0{status}\r\n{lines}\r\n".encode()


async def publish_both(stream: Stream, queue: str, batch: list[tuple[Any, ...]]) -> None:
    """Publish each message of the batch to the stream (raw HPUB) and to the queue."""
    client = await nats.connect(stream.url)
    connection = await aio_pika.connect(AMQP_URL)
    try:
        jetstream = client.jetstream()
        channel = await connection.channel(publisher_confirms=True)
        for kind, status, headers, body, reply_id in batch:
            if kind == "valid":
                signed = {**headers, **outbox_headers(reply_id, body, SECRET)}
                nats_headers = {"Nats-Msg-Id": broker_message_id(SECRET, reply_id), **signed}
                await jetstream.publish(f"{stream.prefix}.k", body, headers=nats_headers)
                amqp_headers: dict[str, Any] = dict(signed)
            else:
                block = header_block(status, headers)
                await raw_publish(stream.url, f"{stream.prefix}.k", block, body)
                amqp_headers = dict(headers)
            await channel.default_exchange.publish(
                aio_pika.Message(body, headers=amqp_headers, message_id=reply_id or None),
                routing_key=queue,
            )
        await client.flush()
    finally:
        await client.close()
        await connection.close()


@pytest.fixture
def dead_lettered_queue() -> Iterator[tuple[str, str]]:
    """A queue whose refused messages go to a dead-letter queue; both deleted after."""
    name, dead = unique("fuzz"), unique("fuzz_dead")

    async def declare(delete: bool) -> None:
        connection = await aio_pika.connect(AMQP_URL, timeout=5)
        try:
            channel = await connection.channel()
            if delete:
                await channel.queue_delete(name)
                await channel.queue_delete(dead)
                return
            await channel.declare_queue(dead, durable=True)
            arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
            await channel.declare_queue(name, durable=True, arguments=arguments)
        finally:
            await connection.close()

    asyncio.run(declare(delete=False))
    yield name, dead
    asyncio.run(declare(delete=True))


@pytest.mark.parametrize("backend", ["postgresql"])
def test_arbitrary_messages_never_stop_a_consumer_nor_pass_for_replies(
    db_url: str, nats_stream: Stream, dead_lettered_queue: tuple[str, str]
) -> None:
    queue, dead = dead_lettered_queue
    store = ReceiptStore(db_url)
    nats_side = nats_consumer(store, nats_stream, batch=5)
    rabbit_side = RabbitMQConsumer(
        store, url=AMQP_URL, queue=queue, secrets=[SECRET], effect=record_effect, batch=5
    )
    numbers = itertools.count()
    totals = {"valid": 0, "junk": 0}
    applied: list[str] = []

    with consuming(nats_side, rabbit_side) as running:

        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        )
        @given(batches)
        def example(drawn: list[tuple[str, str, dict[str, str], bytes]]) -> None:
            batch = []
            for kind, status, headers, body in drawn:
                reply_id = f"v{next(numbers)}" if kind == "valid" else ""
                if kind == "valid":
                    body = body_of(reply_id)
                    applied.append(reply_id)
                totals[kind] += 1
                batch.append((kind, status, headers, body, reply_id))

            async def settle() -> None:
                await publish_both(nats_stream, queue, batch)

                async def done() -> bool:
                    decided = all(
                        sum(consumed(c.metrics, o) for o in ("stored", "duplicate", "invalid"))
                        == totals["valid"] + totals["junk"]
                        for c in (nats_side, rabbit_side)
                    )
                    return (
                        decided
                        and await settled(nats_stream)
                        and await queue_waiting(queue) == 0
                        and await queue_waiting(dead) == totals["junk"]
                    )

                await until(done, WAIT, "every message decided and settled on both brokers")

            asyncio.run(settle())
            assert running.alive()
            # One of the two brokers stores each reply, the other finds it a duplicate.
            for c in (nats_side, rabbit_side):
                assert consumed(c.metrics, "invalid") == totals["junk"]
                assert consumed(c.metrics, "retry") == consumed(c.metrics, "held") == 0

        example()

    try:
        assert sorted(stored_receipts(db_url)) == sorted(applied)
        assert count_effects(db_url) == len(applied)
    finally:
        store.close()
