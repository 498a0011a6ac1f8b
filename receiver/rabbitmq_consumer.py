"""Consume from a RabbitMQ queue with the receiver's dedupe (aio-pika).

    consumer = RabbitMQConsumer(store, url="amqp://guest:guest@127.0.0.1:5672/",
                                queue="billing", secrets=["whsec_..."], effect=apply)
    await consumer.run()          # until consumer.stop()

The queue must exist (declaring it and its bindings is the operator's topology, made
before the relay publishes). Messages arrive with manual acks and a prefetch of one
batch; each batch is decided in one transaction (receiver.consume) and then settled:
``ack`` after its commit (a ``dead`` message too, once kept in the receiver's dead
letters), ``reject`` without requeue when invalid (dead-lettered if the queue has a
dead-letter exchange). A message that was not applied (``retry``: its
transaction or its effect failed; ``held``: an earlier message of its ordering key is
still to be applied) is left unacknowledged, and once the others are settled the
channel is closed: RabbitMQ puts every unacknowledged message back in its place in the
queue, and the consumer opens a new channel (after a pause when nothing was settled),
so a key's messages are still applied in queue order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from outbox.clients import optional_client
from outbox.errors import ConfigError
from receiver.consume import (
    DEFAULT_BACKOFF,
    DEFAULT_BACKOFF_CAP,
    DEFAULT_BATCH,
    DEFAULT_KEY_HOLD,
    DEFAULT_MAX_DELIVERIES,
    BatchStore,
    Consumer,
)
from receiver.deliveries import Delivery, lowercased
from receiver.effects import Effect
from receiver.metrics import ConsumerMetrics
from receiver.outcomes import ACKNOWLEDGED, REDELIVERED, Outcome

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

DELIVERY_COUNT_HEADER = "x-delivery-count"
IDLE_WAIT = 1.0
"""Seconds an idle consumer waits for a message before it looks at its channel again."""

LINGER = 0.005
"""Seconds a batch waits for one more message once the inbox is empty."""

log = logging.getLogger("outbox.receiver.consume")


def _aio_pika() -> Any:
    """The aio_pika package, or a ConfigError saying how to install it."""
    return optional_client("rabbitmq", "consuming from RabbitMQ", "aio_pika", "aio_pika.exceptions")


class _ChannelLost(Exception):
    """The channel closed under us: its unacknowledged messages are back in the queue."""


class RabbitMQConsumer(Consumer):
    """A RabbitMQ queue consumer feeding the receipt store; run() until stop()."""

    broker = "rabbitmq"

    @property
    def source(self) -> str:
        """The queue read, as the process spans name it."""
        return self.queue

    def __init__(
        self,
        store: BatchStore,
        *,
        url: str,
        queue: str,
        secrets: Iterable[str | bytes] | None = None,
        unsigned: bool = False,
        effect: Effect | None = None,
        batch: int = DEFAULT_BATCH,
        backoff: float = DEFAULT_BACKOFF,
        backoff_cap: float = DEFAULT_BACKOFF_CAP,
        metrics: ConsumerMetrics | None = None,
        key_hold: float = DEFAULT_KEY_HOLD,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        continue_traces: bool = False,
    ) -> None:
        """Consume `queue` at `url` (amqp:// or amqps://); `batch` is also the prefetch;
        `continue_traces`: see receiver.consume.Consumer."""
        _aio_pika()
        if not url.startswith(("amqp://", "amqps://")):
            raise ConfigError(
                f"a RabbitMQ url starts with amqp:// or amqps://, got {url.split(':')[0]}:"
            )
        if not queue:
            raise ConfigError("a RabbitMQ consumer needs a queue")
        super().__init__(
            store,
            secrets=secrets,
            unsigned=unsigned,
            effect=effect,
            batch=batch,
            backoff=backoff,
            backoff_cap=backoff_cap,
            metrics=metrics,
            key_hold=key_hold,
            max_deliveries=max_deliveries,
            continue_traces=continue_traces,
        )
        self.url = url
        self.queue = queue

    async def run(self) -> None:
        """Connect, check the queue, consume until stop(); reconnect after a lost connection."""
        aio_pika = _aio_pika()
        # Started before RabbitMQ is up (a sidecar beside it, say), it waits as it does
        # after a lost connection: a refusal is a warning, not an exit.
        connected = await self._connecting(self.backoff)
        if connected is None:
            log.info("stopped before RabbitMQ answered")
            return
        connection = connected
        try:
            await self._check_queue(connection)
            log.info(
                "consuming queue %s",
                self.queue,
                extra={"fields": {"queue": self.queue}},
            )
            while not self.stopping:
                try:
                    await self._session(connection)
                except (
                    _ChannelLost,
                    aio_pika.exceptions.AMQPError,
                    OSError,
                    RuntimeError,  # aio-pika's "connection closed", and a dead channel's
                    TimeoutError,
                ) as exc:
                    # A lost connection can still look open (is_closed is set late, if
                    # ever): whatever failed, start again on a new one.
                    log.warning("RabbitMQ connection lost, connecting again: %s", exc)
                    await _close(connection)
                    connection = await self._reconnect(connection)
        finally:
            await _close(connection)

    async def _connect(self) -> AbstractConnection:
        aio_pika = _aio_pika()
        try:
            connection: AbstractConnection = await aio_pika.connect(self.url)
        except Exception as exc:  # aio-pika raises assorted errors here
            raise ConnectionError(f"cannot connect to RabbitMQ: {exc}") from exc
        return connection

    async def _connecting(self, delay: float) -> AbstractConnection | None:
        """Connect; after each refusal pause `delay` (doubling, capped) and try again. None
        if stop() comes first (a connect to an address that never answers has no end of
        its own)."""
        while not self.stopping:
            try:
                connection = await self.unless_stopped(self._connect())
            except ConnectionError as exc:
                log.warning("%s; trying again", exc)
                await self.pause(delay)
                delay = min(self.backoff_cap, delay * 2)
                continue
            return connection
        return None

    async def _reconnect(self, closed: AbstractConnection) -> AbstractConnection:
        """Connect again after a pause (doubling, capped, per failed try); the closed one
        back if stop() comes first."""
        await self.pause(self.backoff)
        connection = await self._connecting(min(self.backoff_cap, self.backoff * 2))
        return closed if connection is None else connection

    async def _check_queue(self, connection: AbstractConnection) -> None:
        """A missing queue is a ConfigError (a passive declare fails on its own channel)."""
        aio_pika = _aio_pika()
        channel = await connection.channel()
        try:
            await channel.get_queue(self.queue, ensure=True)
        except aio_pika.exceptions.ChannelClosed as exc:
            raise ConfigError(f"RabbitMQ has no queue {self.queue!r}: {exc}") from exc
        finally:
            if not channel.is_closed:
                await channel.close()

    async def _session(self, connection: AbstractConnection) -> None:
        """Consume on one channel until stop() or a batch to retry; closing it requeues."""
        channel = await connection.channel()
        retry = False
        try:
            await channel.set_qos(prefetch_count=self.batch)
            queue = await channel.get_queue(self.queue, ensure=False)
            inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
            await queue.consume(inbox.put, no_ack=False)
            while not self.stopping and not retry:
                batch = await self._gather(inbox, channel)
                if batch:
                    deliveries = [_delivery(message, self.queue) for message in batch]
                    outcomes = await self.consume_batch(deliveries)
                    retry = await self._settle(batch, outcomes)
        finally:
            if not channel.is_closed:
                # Whatever is unacknowledged (prefetched, or to retry) returns to the queue.
                await channel.close()
        await self.pause(self.retry_delay())

    async def _gather(
        self, inbox: asyncio.Queue[AbstractIncomingMessage], channel: AbstractChannel
    ) -> list[AbstractIncomingMessage]:
        """The messages at hand, up to a batch; waits for the first, or returns [] when idle."""
        if inbox.empty():
            getting = asyncio.ensure_future(inbox.get())
            stopping = asyncio.ensure_future(self.wait_stopped())
            done, _ = await asyncio.wait(
                {getting, stopping}, timeout=IDLE_WAIT, return_when=asyncio.FIRST_COMPLETED
            )
            stopping.cancel()
            if getting not in done:
                getting.cancel()
                if channel.is_closed:
                    raise _ChannelLost("the channel closed")
                return []
            batch = [getting.result()]
        else:
            batch = []
        while len(batch) < self.batch:
            if inbox.empty():
                # The broker sends a prefetch's messages one frame each: wait a moment
                # for the rest so they share one transaction.
                try:
                    batch.append(await asyncio.wait_for(inbox.get(), LINGER))
                except TimeoutError:
                    break
            else:
                batch.append(inbox.get_nowait())
        return batch

    async def _settle(
        self, messages: list[AbstractIncomingMessage], outcomes: list[Outcome]
    ) -> bool:
        """ack what is done with, reject what is invalid; True: some are to come again."""
        if all(outcome in ACKNOWLEDGED for outcome in outcomes):
            # Delivery tags grow in arrival order and every earlier one is settled: one
            # ack with multiple=True covers the whole batch.
            await messages[-1].ack(multiple=True)
            return False
        retry = False
        for message, outcome in zip(messages, outcomes, strict=True):
            if outcome == "invalid":
                await message.reject(requeue=False)
            elif outcome in REDELIVERED:
                retry = True  # left unacknowledged: closing the channel requeues it
            else:
                await message.ack()
        return retry


async def _close(connection: AbstractConnection) -> None:
    """Close a connection that may already be dead; closing it cannot fail the consumer."""
    with contextlib.suppress(Exception):  # a dead connection fails in assorted ways
        await connection.close()


def _delivery(message: AbstractIncomingMessage, queue: str) -> Delivery:
    """The broker-free view of an AMQP message."""
    # Quorum queues count deliveries that came back (x-delivery-count, absent on the
    # first); classic queues only say whether it came before.
    returned = (message.headers or {}).get(DELIVERY_COUNT_HEADER)
    count = returned + 1 if isinstance(returned, int) and not isinstance(returned, bool) else None
    return Delivery(
        headers=lowercased(message.headers),
        body=message.body,
        broker_id=message.message_id,
        redelivered=bool(message.redelivered) or bool(count and count > 1),
        deliveries=count,
        broker_ref=queue,
    )
