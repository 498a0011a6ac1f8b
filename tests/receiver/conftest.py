"""Fixtures of the receiver tests: a receipt store on the test database; a stream or a queue of
the test's own, deleted after."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from support.broker_messages import AMQP_URL, NATS_URL, Stream, unique, unreachable

from receiver import ReceiptStore


@pytest.fixture
def store(db_url: str) -> Iterator[ReceiptStore]:
    """A store on the test database (a test file may define its own, with a clock)."""
    opened = ReceiptStore(db_url)
    yield opened
    opened.close()


@pytest.fixture
def nats_stream() -> Iterator[Stream]:
    """A fresh JetStream stream on the local server, deleted after the test."""
    import nats

    stream = Stream(unique("CONSUME"), unique("consume"), unique("durable"))

    async def create() -> None:
        client = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)
        try:
            await client.jetstream().add_stream(name=stream.name, subjects=[f"{stream.prefix}.>"])
        finally:
            await client.close()

    async def delete() -> None:
        client = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)
        try:
            await client.jetstream().delete_stream(stream.name)
        finally:
            await client.close()

    try:
        asyncio.run(create())
    except Exception as exc:
        unreachable(f"NATS JetStream at {NATS_URL}", exc)
    yield stream
    asyncio.run(delete())


@pytest.fixture
def rabbit_queue() -> Iterator[str]:
    """A fresh durable queue on the local RabbitMQ, deleted after the test."""
    import aio_pika

    name = unique("consume")

    async def declare(delete: bool) -> None:
        connection = await aio_pika.connect(AMQP_URL, timeout=5)
        try:
            channel = await connection.channel()
            if delete:
                await channel.queue_delete(name)
            else:
                await channel.declare_queue(name, durable=True)
        finally:
            await connection.close()

    try:
        asyncio.run(declare(delete=False))
    except Exception as exc:
        unreachable(f"RabbitMQ at {AMQP_URL}", exc)
    yield name
    asyncio.run(declare(delete=True))
