"""Broker messages as the relay publishes them, and the brokers' test fixtures' plumbing.

`outbox_headers` builds exactly the header set of relay/transports/broker_headers.py (the
message's own headers, Standard Webhooks id/timestamp/signature via
outbox.signing.sign, content-type, user-agent, outbox-content-hash), so the consumer
tests need no relay. Under CI=true a broker that cannot be reached fails the test.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from outbox.canonical import sha256_hex
from outbox.signing import CONTENT_HASH_HEADER, ID_HEADER, ORDERING_KEY_HEADER, sign
from receiver.deliveries import Delivery, lowercased
from support.environment import IN_CI
from support.nats_helpers import NATS_URL
from support.rabbitmq import AMQP_URL

USER_AGENT = "outbox-relay/0.1"


@dataclass(frozen=True)
class Stream:
    """A JetStream stream taking `prefix`.> subjects, and a durable name, for one test."""

    name: str
    prefix: str
    durable: str
    url: str = NATS_URL


def outbox_headers(
    reply_id: str,
    body: bytes,
    secret: str | None,
    *,
    own: dict[str, str] | None = None,
    timestamp: float | None = None,
) -> dict[str, str]:
    """The headers the relay's broker transports send with `body` (unsigned: secret None)."""
    signature = sign(secret, reply_id, timestamp, body) if secret else {ID_HEADER: reply_id}
    return {
        **(own or {}),
        **signature,
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        CONTENT_HASH_HEADER: sha256_hex(body),
    }


def delivery(
    reply_id: str,
    key: str | None = None,
    *,
    secret: str | None = None,
    own: dict[str, str] | None = None,
    **broker: Any,
) -> Delivery:
    """A broker message as the relay publishes it, JSON body {"reply": reply_id}, with the
    ordering key `key` (unsigned unless `secret`), as a consumer is handed it; `broker`
    sets the Delivery's own fields (redelivered, broker_ref, ...)."""
    body = json.dumps({"reply": reply_id}).encode()
    headers = outbox_headers(reply_id, body, secret, own=own)
    if key is not None:
        headers[ORDERING_KEY_HEADER] = key
    return Delivery(lowercased(headers), body, reply_id, **broker)


def unique(prefix: str) -> str:
    """A name no other test run uses."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def unreachable(what: str, exc: BaseException) -> None:
    """Fail under CI, skip elsewhere: the broker is not running."""
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true and is unreachable: {exc}")
    pytest.skip(f"{what} unreachable: {exc}")


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Poll an async predicate until true, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def consumed(metrics: Any, outcome: str) -> int:
    """How many messages a ConsumerMetrics counted with `outcome`."""
    value = metrics.registry.get_sample_value(
        "outbox_receiver_consumed_total", {"outcome": outcome}
    )
    return int(value or 0)


async def queue_waiting(queue: str) -> int:
    """Messages ready in a RabbitMQ queue (not counting those a consumer holds)."""
    import aio_pika  # only the RabbitMQ tests ask

    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)
    finally:
        await connection.close()
