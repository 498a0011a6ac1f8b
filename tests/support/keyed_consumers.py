"""Keyed scenarios that both broker consumers run, each broker through its own adapter.

A failing message holds back its ordering key alone until it passes; a message
whose effect always raises goes dead after the consumer's bound and releases its
key. The brokers differ only in how a message is published with its key, how the
consumer is made and how a test sees that nothing is left unacknowledged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from receiver import ReceiptStore
from receiver.metrics import ConsumerMetrics
from support.broker_messages import consumed, until
from support.receiver_helpers import InOrder, count_effects, stored_receipts

WAIT = 30.0
FIRST = [("a1", "A"), ("b1", "B"), ("a2", "A"), ("u1", None)]
"""Published before the consumer starts: two keys, and one message without a key."""


class Consumer(Protocol):
    """A broker consumer as the scenarios drive it."""

    metrics: ConsumerMetrics

    async def run(self) -> None:
        """Consume until stopped."""

    def stop(self) -> None:
        """Stop after the batch in hand."""


@dataclass(frozen=True)
class KeyedBroker:
    """What a scenario needs of one broker's test stream or queue."""

    send: Callable[[str, str | None], Awaitable[None]]
    """Publish a signed message with this reply_id, carrying this ordering key (or none)."""
    consumer: Callable[..., Consumer]
    """A consumer of the test's stream or queue: (store, **options)."""
    drained: Callable[[], Awaitable[bool]]
    """Nothing waits for delivery or for an acknowledgement (while the consumer runs)."""


@asynccontextmanager
async def running(consumer: Consumer) -> AsyncIterator[Consumer]:
    """The consumer running in a task; stopped and awaited at the end of the block."""
    task = asyncio.ensure_future(consumer.run())
    try:
        yield consumer
    finally:
        consumer.stop()
        await asyncio.wait_for(task, WAIT)


def a_failing_message_holds_back_its_key_alone(broker: KeyedBroker, db_url: str) -> None:
    """a2 fails until let through: B and unkeyed messages go on, A's later ones wait,
    then all of A is applied in order, each message once."""
    effect = InOrder("a2")
    store = ReceiptStore(db_url)

    async def scenario() -> None:
        for reply_id, key in [*FIRST, ("b2", "B"), ("a3", "A")]:
            await broker.send(reply_id, key)
        # a2 fails until the test lets it pass, however often: it must not go dead first.
        consumer = broker.consumer(
            store, effect=effect, backoff=0.05, backoff_cap=0.2, max_deliveries=10**6
        )
        async with running(consumer):

            async def others_done() -> bool:
                return consumed(consumer.metrics, "stored") == 4 and (
                    consumed(consumer.metrics, "retry") >= 2
                )

            await until(others_done, WAIT, "the other keys stored while a2 fails")
            # A later message of A arriving meanwhile waits too; B goes on.
            await broker.send("a4", "A")
            await broker.send("b3", "B")

            async def b3_done() -> bool:
                # a4 is held in its own delivery, which may be counted after b3's store.
                stored, held = (
                    consumed(consumer.metrics, "stored"),
                    consumed(consumer.metrics, "held"),
                )
                return stored == 5 and held >= 2

            await until(b3_done, WAIT, "b3 stored and A's later messages held while a2 fails")
            assert set(stored_receipts(db_url)) == {"a1", "b1", "u1", "b2", "b3"}
            effect.failing.clear()

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == 8 and await broker.drained()

            await until(done, WAIT, "a2, a3 and a4 stored once a2 passes")

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    assert effect.out_of_order == [], effect.out_of_order
    assert len(stored_receipts(db_url)) == count_effects(db_url) == 8


def a_message_that_always_fails_goes_dead(
    broker: KeyedBroker, db_url: str, after_stop: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    """a1's effect always raises: with max_deliveries 3 it goes dead on its third failure,
    the others are stored, a2 after it; `after_stop` checks the broker once the consumer
    stopped. Returns a1's dead letter for the broker's own checks."""
    effect = InOrder("a1")  # a1 can never be applied
    store = ReceiptStore(db_url)

    async def scenario() -> None:
        for reply_id, key in FIRST:
            await broker.send(reply_id, key)
        consumer = broker.consumer(
            store, effect=effect, backoff=0.05, backoff_cap=0.2, max_deliveries=3
        )
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == 3 and (
                    consumed(consumer.metrics, "dead") == 1
                )

            await until(done, WAIT, "a1 dead, the others stored")
            assert consumed(consumer.metrics, "retry") == 2
        # Stopped: whatever was not acknowledged would be waiting again now.
        await after_stop()

    try:
        asyncio.run(scenario())
        letter = store.dead_letter("a1")
    finally:
        store.close()
    assert letter is not None
    assert letter["failures"] == 3
    assert letter["reason"] == "RuntimeError: a1 cannot be applied yet"
    assert set(stored_receipts(db_url)) == {"b1", "a2", "u1"}
    assert effect.out_of_order == ["a2"]  # applied without a1: a dead message holds nothing
    return dict(letter)
