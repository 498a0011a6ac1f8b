"""The local RabbitMQ for tests: an exchange and queue of the test's own, and what it holds.

Every test declares its own exchange and queue (unique names) and deletes them
after, so runs never see each other's messages. Under CI=true a broker that
cannot be reached fails the test; elsewhere the test is skipped.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from support.environment import IN_CI

AMQP_URL = os.environ.get("OUTBOX_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


@dataclass(frozen=True)
class Queued:
    """One message as the queue holds it."""

    body: bytes
    message_id: str | None
    routing_key: str | None
    delivery_mode: int | None
    content_type: str | None
    headers: Mapping[str, Any]


@dataclass(frozen=True)
class Topology:
    """An exchange and a queue bound to it, of one test."""

    exchange: str
    queue: str


def unique(prefix: str) -> str:
    """A name no other test run uses."""
    return f"outbox-test-{prefix}-{uuid.uuid4().hex[:12]}"


async def _declare(
    exchange: str,
    kind: str,
    queue: str,
    bindings: Sequence[str],
    queue_arguments: Mapping[str, Any] | None,
) -> None:
    import aio_pika

    connection = await aio_pika.connect(AMQP_URL, timeout=10)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_exchange(exchange, kind, durable=True)
        bound = await channel.declare_queue(
            queue, durable=True, arguments=dict(queue_arguments or {})
        )
        for key in bindings:
            await bound.bind(declared, key)


async def _delete(exchange: str | None, queue: str | None) -> None:
    import aio_pika

    connection = await aio_pika.connect(AMQP_URL, timeout=10)
    async with connection:
        channel = await connection.channel()
        if queue is not None:
            await channel.queue_delete(queue)
        if exchange is not None:
            await channel.exchange_delete(exchange)


def reachable() -> None:
    """Fail (under CI) or skip the test when the broker cannot be reached."""

    async def ping() -> None:
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL, timeout=5)
        await connection.close()

    try:
        asyncio.run(ping())
    except Exception as exc:
        if IN_CI:
            pytest.fail(f"RabbitMQ is required under CI=true and is unreachable: {exc}")
        pytest.skip(f"RabbitMQ unreachable at {AMQP_URL}: {exc}")


@contextmanager
def topology(
    kind: str = "topic",
    bindings: Sequence[str] = ("#",),
    queue_arguments: Mapping[str, Any] | None = None,
) -> Iterator[Topology]:
    """A durable exchange of `kind` and a durable queue bound to it by `bindings`; both
    deleted after."""
    reachable()
    made = Topology(unique("exchange"), unique("queue"))
    asyncio.run(_declare(made.exchange, kind, made.queue, bindings, queue_arguments))
    try:
        yield made
    finally:
        asyncio.run(_delete(made.exchange, made.queue))


def delete_exchange(exchange: str) -> None:
    """Delete an exchange now (a test's topology goes away under a running relay)."""
    asyncio.run(_delete(exchange, None))


def take_all(queue: str) -> list[Queued]:
    """Every message the queue holds, in queue order, taken off it (acknowledged)."""

    async def take() -> list[Queued]:
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL, timeout=10)
        async with connection:
            channel = await connection.channel()
            bound = await channel.get_queue(queue, ensure=True)
            taken: list[Queued] = []
            while (message := await bound.get(no_ack=True, fail=False)) is not None:
                taken.append(
                    Queued(
                        message.body,
                        message.message_id,
                        message.routing_key,
                        message.delivery_mode,
                        message.content_type,
                        dict(message.headers),
                    )
                )
            return taken

    return asyncio.run(take())


def delete_topology(exchange: str | None, queue: str | None) -> None:
    """Delete what a test declared (or a command under test declared for it); gone is fine."""
    reachable()
    asyncio.run(_delete(exchange, queue))


def exchange_exists(exchange: str) -> bool:
    """Whether the broker has an exchange of this name (a passive declare)."""

    async def look() -> bool:
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL, timeout=10)
        async with connection:
            channel = await connection.channel()
            try:
                await channel.get_exchange(exchange, ensure=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                return False
            return True

    return asyncio.run(look())
