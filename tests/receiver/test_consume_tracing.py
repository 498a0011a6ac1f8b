"""The broker consumers' `process {stream or queue}` spans against the local NATS and
RabbitMQ (receiver.consume, receiver.spans): one per fetched batch, linked to each
message's creation context from its headers, with the dedupe outcomes; a batch of one
continues the publisher's trace when asked (continue_traces)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import nats
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support.broker_messages import AMQP_URL, Stream, consumed, outbox_headers, until
from support.keyed_consumers import Consumer, running
from support.receiver_helpers import SECRET
from support.tracing import ids, linked, named, spans, traceparent

from receiver import NatsConsumer, RabbitMQConsumer, ReceiptStore
from receiver.effects import record_effect
from receiver.spans import OUTCOME

__all__ = ["spans"]  # the fixture, used by name

WAIT = 30.0
CONTEXTS = [(0x0C1 + n, 0x0D1 + n) for n in range(3)]
"""Trace and span ids of the publishers' spans, one a message."""
PREFIX = "outbox.dedupe."


@dataclass(frozen=True)
class Broker:
    """One broker as these tests drive it: where its consumer reads, and how to publish."""

    system: str
    """Its `messaging.system`."""
    source: str
    """The stream or queue its consumer reads, which names the process spans."""
    send: Callable[[str, bytes, str], Awaitable[None]]
    """Publish a signed message (reply_id, body) carrying a traceparent, as the relay does."""
    consumer: Callable[..., Consumer]
    """A consumer of the test's stream or queue with the reference effect: (store, **options)."""


def nats_broker(stream: Stream) -> Broker:
    """The test's JetStream stream."""

    async def send(reply_id: str, body: bytes, context: str) -> None:
        headers = outbox_headers(reply_id, body, SECRET, own={"traceparent": context})
        client = await nats.connect(stream.url)
        try:
            await client.jetstream().publish(f"{stream.prefix}.k", body, headers=headers)
        finally:
            await client.close()

    def consumer(store: ReceiptStore, **options: Any) -> Consumer:
        return NatsConsumer(
            store,
            url=stream.url,
            stream=stream.name,
            durable=stream.durable,
            secrets=[SECRET],
            effect=record_effect,
            **options,
        )

    return Broker("nats", stream.name, send, consumer)


def rabbitmq_broker(queue: str) -> Broker:
    """The test's RabbitMQ queue."""

    async def send(reply_id: str, body: bytes, context: str) -> None:
        headers = outbox_headers(reply_id, body, SECRET, own={"traceparent": context})
        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel(publisher_confirms=True)
            message = aio_pika.Message(
                body, headers=dict(headers), message_id=reply_id, content_type="application/json"
            )
            await channel.default_exchange.publish(message, routing_key=queue)
        finally:
            await connection.close()

    def consumer(store: ReceiptStore, **options: Any) -> Consumer:
        return RabbitMQConsumer(
            store, url=AMQP_URL, queue=queue, secrets=[SECRET], effect=record_effect, **options
        )

    return Broker("rabbitmq", queue, send, consumer)


@pytest.fixture(params=["nats", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> Broker:
    """Each broker in turn, with a stream or queue of the test's own."""
    if request.param == "nats":
        return nats_broker(request.getfixturevalue("nats_stream"))
    return rabbitmq_broker(request.getfixturevalue("rabbit_queue"))


def body_of(reply_id: str) -> bytes:
    """A JSON body naming its message."""
    return json.dumps({"reply": reply_id}).encode()


def consume(broker: Broker, store: ReceiptStore, sent: int, **options: Any) -> None:
    """Run a consumer until it has consumed `sent` messages, then stop it."""

    async def scenario() -> None:
        consumer = broker.consumer(store, **options)
        async with running(consumer):

            async def done() -> bool:
                counts = [
                    consumed(consumer.metrics, o) for o in ("stored", "duplicate", "conflict")
                ]
                return sum(counts) == sent

            await until(done, WAIT, f"{sent} messages consumed")

    asyncio.run(scenario())


def outcomes(span: ReadableSpan) -> Counter[str]:
    """A process span's outcomes: a single message's, or a batch's counts."""
    attributes = dict(span.attributes or {})
    if OUTCOME in attributes:
        return Counter([str(attributes[OUTCOME])])
    counts = {name: n for name, n in attributes.items() if name.startswith(PREFIX)}
    return Counter({name.removeprefix(PREFIX): int(str(n)) for name, n in counts.items()})


def test_each_fetched_batch_is_a_span_linked_to_its_messages_with_their_outcomes(
    broker: Broker, store: ReceiptStore, spans: InMemorySpanExporter
) -> None:
    store.accept("dup", body_of("dup"), record_effect)
    store.accept("taken", body_of("another body"), record_effect)
    sent = dict(zip(["new", "dup", "taken"], CONTEXTS, strict=True))

    async def publish() -> None:
        for reply_id, context in sent.items():
            await broker.send(reply_id, body_of(reply_id), traceparent(*context))

    asyncio.run(publish())
    consume(broker, store, len(sent))
    made = named(spans.get_finished_spans(), f"process {broker.source}")
    # However the broker handed them over, each message is in one span, linked once.
    assert sorted(link for span in made for link in linked(span)) == sorted(sent.values())
    assert sum((outcomes(span) for span in made), Counter()) == Counter(
        stored=1, duplicate=1, conflict=1
    )
    for span in made:
        attributes = dict(span.attributes or {})
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is None
        assert attributes["messaging.system"] == broker.system
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.destination.name"] == broker.source
        if len(span.links) == 1:
            assert attributes["messaging.message.id"] in sent
        else:
            assert attributes["messaging.batch.message_count"] == len(span.links)


@pytest.mark.parametrize("continue_traces", [False, True])
def test_a_batch_of_one_continues_the_publishers_trace_when_asked(
    broker: Broker, store: ReceiptStore, spans: InMemorySpanExporter, continue_traces: bool
) -> None:
    asyncio.run(broker.send("one", body_of("one"), traceparent(*CONTEXTS[0])))
    consume(broker, store, 1, batch=1, continue_traces=continue_traces)
    (span,) = named(spans.get_finished_spans(), f"process {broker.source}")
    if continue_traces:
        assert (ids(span.parent), linked(span)) == (CONTEXTS[0], [])
    else:
        assert (span.parent, linked(span)) == (None, [CONTEXTS[0]])
    assert dict(span.attributes or {}) == {
        "messaging.system": broker.system,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": broker.source,
        "messaging.message.id": "one",
        OUTCOME: "stored",
    }
