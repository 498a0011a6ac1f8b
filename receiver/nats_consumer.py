"""Consume from a JetStream durable pull consumer with the receiver's dedupe (nats-py).

    consumer = NatsConsumer(store, url="nats://127.0.0.1:4222", stream="ORDERS",
                            durable="billing", secrets=["whsec_..."], effect=apply)
    await consumer.run()          # until consumer.stop()

The durable consumer is created when missing (explicit acks, ``ack_wait``); an
existing one must be a pull consumer with explicit acks. Batches are fetched, consumed
in one transaction (receiver.consume), then each message is settled: ``ack`` after
its commit, ``term`` when invalid, ``nak`` when it was not applied (``retry``: its
transaction or its effect failed; ``held``: an earlier message of its ordering key
is still to be applied). While a transaction runs longer than a third of
``ack_wait``, the batch is marked in progress so JetStream does not hand it to
another consumer meanwhile.

A ``nak`` asks for no delay: JetStream serves redeliveries before new messages, in
the order they were nakked, so one consumer applies a key's messages in stream order;
a later message of a blocked key that comes first anyway is held (receiver.consume).

The pull requests are the consumer's own (receiver.nats_pull), so a message whose
headers look like a server status is still settled; the durable is made, checked and
watched for stalls by receiver.nats_durable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from outbox.errors import ConfigError
from outbox.redaction import redact_urls
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
from receiver.nats_durable import ensure_durable, watch_durable
from receiver.nats_package import nats_package
from receiver.nats_pull import PullRequests
from receiver.outcomes import REDELIVERED, Outcome

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

DEFAULT_ACK_WAIT = 60.0
DEFAULT_STALL_AFTER = 120.0
"""Seconds a durable with work may go without advancing before it is reported stalled."""
MSG_ID_HEADER = "nats-msg-id"

log = logging.getLogger("outbox.receiver.consume")


class NatsConsumer(Consumer):
    """A JetStream durable pull consumer feeding the receipt store; run() until stop()."""

    broker = "nats"

    @property
    def source(self) -> str:
        """The stream read, as the process spans name it."""
        return self.stream

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
        stall_after: float = DEFAULT_STALL_AFTER,
        continue_traces: bool = False,
    ) -> None:
        """Consume `stream` through the durable consumer `durable` at `url` (nats:// or tls://);
        `stall_after`: seconds a durable with work may go without advancing (see above);
        `continue_traces`: see receiver.consume.Consumer."""
        nats_package()
        if not url.startswith(("nats://", "tls://")):
            raise ConfigError(f"a NATS url starts with nats:// or tls://, got {url.split(':')[0]}:")
        if not stream or not durable:
            raise ConfigError("a NATS consumer needs a stream and a durable consumer name")
        if ack_wait <= 0:
            raise ConfigError("ack_wait must be > 0 seconds")
        if not stall_after > 0:
            raise ConfigError("stall_after must be > 0 seconds")
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
        self.stream = stream
        self.durable = durable
        self.ack_wait = ack_wait
        self.stall_after = float(stall_after)
        self._pulls = PullRequests(stream, durable, self.batch, self)
        self._settled = 0
        """Messages this consumer acknowledged or terminated: the stall check's progress."""

    async def run(self) -> None:
        """Connect, ensure the durable consumer, consume until stop(); then flush and close."""
        nats = nats_package()
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
        watching: asyncio.Future[None] | None = None
        try:
            jetstream = client.jetstream()
            await ensure_durable(jetstream, self.stream, self.durable, self.ack_wait)
            inbox = client.new_inbox()
            await client.subscribe(f"{inbox}.*", cb=self._pulls.receive)
            watching = asyncio.ensure_future(
                watch_durable(
                    jetstream,
                    stream=self.stream,
                    durable=self.durable,
                    stall_after=self.stall_after,
                    metrics=self.metrics,
                    settled=lambda: self._settled,
                    stopper=self,
                )
            )
            log.info(
                "consuming stream %s through durable %s",
                self.stream,
                self.durable,
                extra={"fields": {"stream": self.stream, "durable": self.durable}},
            )
            while not self.stopping:
                await self._turn(client, inbox)
            await self._give_back()
            await client.flush()  # the last acks leave before the connection closes
        finally:
            if watching is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
            await client.close()

    async def _give_back(self) -> None:
        """Nak what arrived after the last turn took its batch (late answers to a pull cut
        short by the stop): redelivered at once, in order, rather than after ack_wait,
        while a restarted consumer would take newer messages of their keys first."""
        nats = nats_package()
        for message in self._pulls.left_over():
            try:
                await message.nak()
            except nats.errors.Error as exc:
                log.warning("giving a message back to NATS failed: %s", exc)

    async def _turn(self, client: Client, inbox: str) -> None:
        """Pull one batch, consume it, settle; after a failure, pause before the next pull."""
        nats = nats_package()
        try:
            messages = await self._pulls.pull(client, inbox)
        except nats.errors.Error as exc:
            log.warning("fetching from NATS failed: %s", exc)
            await self.pause(self.backoff)
            return
        if not messages:
            return  # nothing to consume right now
        outcomes = await self._consume_in_progress(messages)
        await self._settle(messages, outcomes)
        await self.pause(self.retry_delay())

    async def _consume_in_progress(self, messages: list[Msg]) -> list[Outcome]:
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
        deciding = asyncio.ensure_future(self.consume_batch(deliveries))
        while True:
            done, _ = await asyncio.wait({deciding}, timeout=self.ack_wait / 3)
            if done:
                return deciding.result()
            for message in messages:
                await message.in_progress()

    async def _settle(self, messages: list[Msg], outcomes: list[Outcome]) -> None:
        """ack what is done with, term what is invalid, nak what was not applied."""
        nats = nats_package()
        for message, outcome in zip(messages, outcomes, strict=True):
            try:
                if outcome == "invalid":
                    await message.term()
                    self._settled += 1
                elif outcome in REDELIVERED:
                    # Now, not delayed: a delay would let newer messages of the key
                    # overtake it. JetStream serves redeliveries before newer messages.
                    await message.nak()
                else:
                    await message.ack()
                    self._settled += 1
            except nats.errors.Error as exc:
                # Not acknowledged: JetStream delivers it again after ack_wait, a duplicate.
                log.warning("settling a message on NATS failed: %s", exc)


def _deliveries(message: Msg) -> dict[str, Any]:
    """What JetStream says of a message's deliveries, and its stream and sequence."""
    try:
        metadata = message.metadata
    except Exception:  # noqa: BLE001 - not a JetStream message, or a reply forged as one
        # nats-py raises its own error for a reply subject that is not $JS.ACK, and
        # ValueError for one whose tokens are not numbers: neither may stop the consumer,
        # and the message's own checks still decide it.
        return {}
    count = metadata.num_delivered
    return {
        "redelivered": count > 1,
        "deliveries": count,
        "broker_ref": f"{metadata.stream}/{metadata.sequence.stream}",
    }
