"""Consume from a JetStream durable pull consumer with the receiver's dedupe (nats-py).

    consumer = NatsConsumer(store, url="nats://127.0.0.1:4222", stream="ORDERS",
                            durable="billing", secrets=["whsec_..."], effect=apply)
    await consumer.run()          # until consumer.stop()

The durable consumer is created when missing (explicit acks, ``ack_wait``); an
existing one must be a pull consumer with explicit acks. Batches are fetched, decided
in one transaction (receiver.consume), then each message is settled: ``ack`` after
its commit, ``term`` when invalid, ``nak`` when it was not applied (``retry``: its
transaction or its effect failed; ``held``: an earlier message of its ordering key
is still to be applied). While a transaction runs longer than a third of
``ack_wait``, the batch is marked in progress so JetStream does not hand it to
another consumer meanwhile.

A ``nak`` asks for no delay: JetStream serves redeliveries before new messages, in
the order they were nakked, so one consumer applies a key's messages in stream order;
a later message of a blocked key that comes first anyway is held (receiver.consume).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from outbox.clients import optional_client
from outbox.errors import ConfigError
from outbox.redaction import redact_urls
from receiver.consume import (
    DEFAULT_BACKOFF,
    DEFAULT_BACKOFF_CAP,
    DEFAULT_BATCH,
    DEFAULT_KEY_HOLD,
    DEFAULT_MAX_DELIVERIES,
    REDELIVERED,
    BatchStore,
    Consumer,
    Delivery,
    Outcome,
    lowercased,
)
from receiver.effects import Effect
from receiver.metrics import ConsumerMetrics

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js.client import JetStreamContext

DEFAULT_ACK_WAIT = 60.0
FETCH_WAIT = 1.0
"""Seconds one fetch waits for messages: also how soon an idle consumer sees stop()."""
MSG_ID_HEADER = "nats-msg-id"

log = logging.getLogger("outbox.receiver.consume")


def _nats() -> Any:
    """The nats package, or a ConfigError saying how to install it."""
    return optional_client("nats", "consuming from NATS", "nats", "nats.js.errors")


class NatsConsumer(Consumer):
    """A JetStream durable pull consumer feeding the receipt store; run() until stop()."""

    broker = "nats"

    def __init__(
        self,
        store: BatchStore,
        *,
        url: str,
        stream: str,
        durable: str,
        secrets: Iterable[str | bytes] | None = None,
        unsigned: bool = False,
        effect: Effect | None = None,
        batch: int = DEFAULT_BATCH,
        ack_wait: float = DEFAULT_ACK_WAIT,
        backoff: float = DEFAULT_BACKOFF,
        backoff_cap: float = DEFAULT_BACKOFF_CAP,
        metrics: ConsumerMetrics | None = None,
        key_hold: float = DEFAULT_KEY_HOLD,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> None:
        """Consume `stream` through the durable consumer `durable` at `url` (nats:// or tls://)."""
        _nats()
        if not url.startswith(("nats://", "tls://")):
            raise ConfigError(f"a NATS url starts with nats:// or tls://, got {url.split(':')[0]}:")
        if not stream or not durable:
            raise ConfigError("a NATS consumer needs a stream and a durable consumer name")
        if ack_wait <= 0:
            raise ConfigError("ack_wait must be > 0 seconds")
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
        )
        self.url = url
        self.stream = stream
        self.durable = durable
        self.ack_wait = ack_wait

    async def run(self) -> None:
        """Connect, ensure the durable consumer, consume until stop(); then flush and close."""
        nats = _nats()
        shown = redact_urls(self.url)
        log.info("connecting to NATS at %s", shown)

        async def said(exc: Exception) -> None:
            # One line per error (each failed connect among them; the client tries again
            # on its own): nats-py's own callback logs a traceback each time.
            log.warning("NATS at %s: %s: %s", shown, type(exc).__name__, redact_urls(str(exc)))

        try:
            # nats-py retries an unreachable server for ever here (no reconnect limit):
            # a stop must still end the wait.
            connected: Client | None = await self.unless_stopped(
                nats.connect(
                    self.url, max_reconnect_attempts=-1, allow_reconnect=True, error_cb=said
                )
            )
        except Exception as exc:  # nats-py raises assorted errors here
            raise ConnectionError(f"cannot connect to NATS at {shown}: {exc}") from exc
        if connected is None:
            log.info("stopped before NATS answered")
            return
        client = connected
        try:
            jetstream = client.jetstream()
            await self._ensure_durable(jetstream)
            subscription = await jetstream.pull_subscribe_bind(self.durable, self.stream)
            log.info(
                "consuming stream %s through durable %s",
                self.stream,
                self.durable,
                extra={"fields": {"stream": self.stream, "durable": self.durable}},
            )
            while not self.stopping:
                await self._turn(subscription)
            await client.flush()  # the last acks leave before the connection closes
        finally:
            await client.close()

    async def _ensure_durable(self, jetstream: JetStreamContext) -> None:
        """Create the durable consumer if missing; refuse one that cannot work as we need."""
        nats = _nats()
        from nats.js.api import AckPolicy, ConsumerConfig

        try:
            await jetstream.stream_info(self.stream)
        except nats.js.errors.NotFoundError as exc:
            raise ConfigError(f"JetStream has no stream {self.stream!r}") from exc
        try:
            info = await jetstream.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            config = ConsumerConfig(
                durable_name=self.durable,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.ack_wait,
            )
            await jetstream.add_consumer(self.stream, config=config)
            log.info("created durable consumer %s on stream %s", self.durable, self.stream)
            return
        if info.config.ack_policy != AckPolicy.EXPLICIT:
            raise ConfigError(f"durable consumer {self.durable!r} must use explicit acks")
        if info.config.deliver_subject:
            raise ConfigError(f"durable consumer {self.durable!r} is a push consumer; need pull")

    async def _turn(self, subscription: JetStreamContext.PullSubscription) -> None:
        """Fetch one batch, decide, settle; after a failure, pause before the next fetch."""
        nats = _nats()
        try:
            messages = await subscription.fetch(self.batch, timeout=FETCH_WAIT)
        except TimeoutError:
            return  # nothing to consume right now
        except nats.errors.Error as exc:
            log.warning("fetching from NATS failed: %s", exc)
            await self.pause(self.backoff)
            return
        outcomes = await self._decide_in_progress(messages)
        await self._settle(messages, outcomes)
        await self.pause(self.retry_delay())

    async def _decide_in_progress(self, messages: list[Msg]) -> list[Outcome]:
        """Decide on the batch; mark it in progress while a long transaction runs."""
        deliveries = [
            Delivery(
                headers=(headers := lowercased(message.headers)),
                body=message.data,
                broker_id=headers.get(MSG_ID_HEADER),
                **_deliveries(message),
            )
            for message in messages
        ]
        deciding = asyncio.ensure_future(self.decide(deliveries))
        while True:
            done, _ = await asyncio.wait({deciding}, timeout=self.ack_wait / 3)
            if done:
                return deciding.result()
            for message in messages:
                await message.in_progress()

    async def _settle(self, messages: list[Msg], outcomes: list[Outcome]) -> None:
        """ack what is done with, term what is invalid, nak what was not applied."""
        nats = _nats()
        for message, outcome in zip(messages, outcomes, strict=True):
            try:
                if outcome == "invalid":
                    await message.term()
                elif outcome in REDELIVERED:
                    # Now, not delayed: a delay would let newer messages of the key
                    # overtake it. JetStream serves redeliveries before newer messages.
                    await message.nak()
                else:
                    await message.ack()
            except nats.errors.Error as exc:
                # Not acknowledged: JetStream delivers it again after ack_wait, a duplicate.
                log.warning("settling a message on NATS failed: %s", exc)


def _deliveries(message: Msg) -> dict[str, Any]:
    """What JetStream says of a message's deliveries, and its stream and sequence."""
    nats = _nats()
    try:
        metadata = message.metadata
    except nats.errors.Error:  # not a JetStream message (its reply subject says so)
        return {}
    count = metadata.num_delivered
    return {
        "redelivered": count > 1,
        "deliveries": count,
        "broker_ref": f"{metadata.stream}/{metadata.sequence.stream}",
    }
