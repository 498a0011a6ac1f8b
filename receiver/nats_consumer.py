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

The pull requests are made here, not by nats-py's ``fetch``: it takes any message with
a ``Status`` header for the server's own status message, and drops it (never acked nor
terminated: redelivered for ever) or fails on it, while anyone who may publish to the
stream can set that header. Here a message is a delivery of the stream when it comes
with a ``$JS.ACK`` reply subject, whatever its headers, and is checked, settled and
counted like any other; only a message without one, on the request's own inbox, is the
server's status (404 no messages, 408 request ended, 409, 503 no consumer).

A durable can stop advancing for reasons no single fetch sees (its max_ack_pending
filled by messages nobody settles): every ``stall_after / 4`` seconds the durable is
read, its pending counts go to the metrics, and when it has work but neither its
acknowledgement floor moved nor this consumer settled anything for ``stall_after``
seconds, a warning is logged and ``outbox_receiver_durable_stalled`` is 1.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
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
    BatchStore,
    Consumer,
)
from receiver.deliveries import (
    Delivery,
    lowercased,
)
from receiver.effects import Effect
from receiver.metrics import ConsumerMetrics
from receiver.outcomes import (
    REDELIVERED,
    Outcome,
)

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js.client import JetStreamContext

DEFAULT_ACK_WAIT = 60.0
FETCH_WAIT = 1.0
"""Seconds one pull request waits for a message when none is at hand."""
ANSWER_GRACE = 2.0
"""Seconds past its own end a pull request's answer may take before it counts as lost (a
reconnect drops the server's side of it): the next turn asks again."""
DEFAULT_STALL_AFTER = 120.0
"""Seconds a durable with work may go without advancing before it is reported stalled."""
MSG_ID_HEADER = "nats-msg-id"
ACK_PREFIX = "$JS.ACK."
"""How the reply subject of every JetStream delivery begins; a server status has none."""
ENDS_REQUEST = frozenset({"404", "408", "409"})
"""Statuses that end a pull request: nothing left, its time is up, or it was refused."""

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
        stall_after: float = DEFAULT_STALL_AFTER,
    ) -> None:
        """Consume `stream` through the durable consumer `durable` at `url` (nats:// or tls://);
        `stall_after`: seconds a durable with work may go without advancing (see above)."""
        _nats()
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
        )
        self.url = url
        self.stream = stream
        self.durable = durable
        self.ack_wait = ack_wait
        self.stall_after = float(stall_after)
        self._arrived: list[Msg] = []
        """Deliveries received and not yet taken into a batch."""
        self._ended: set[str] = set()
        """Pull requests (their reply subjects) the server said are over."""
        self._news = asyncio.Event()
        self._settled = 0
        """Messages this consumer acknowledged or terminated: the stall check's progress."""
        self._requests = itertools.count()

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
        watching: asyncio.Future[None] | None = None
        try:
            jetstream = client.jetstream()
            await self._ensure_durable(jetstream)
            inbox = client.new_inbox()
            await client.subscribe(f"{inbox}.*", cb=self._receive)
            watching = asyncio.ensure_future(self._watch(jetstream))
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
        nats = _nats()
        left, self._arrived = self._arrived, []
        for message in left:
            try:
                await message.nak()
            except nats.errors.Error as exc:
                log.warning("giving a message back to NATS failed: %s", exc)

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
        limit = info.config.max_deliver
        if limit is not None and limit > 0:
            # Every nak counts as a delivery, a held message's too: behind a message that
            # keeps failing, its key's later messages could reach the limit and JetStream
            # would stop delivering them, unapplied. --max-deliveries is the bound to use.
            log.warning(
                "durable consumer %s has max_deliver %d: JetStream stops delivering a message "
                "after %d deliveries, held ones included; create it without max_deliver and "
                "bound failing messages with --max-deliveries",
                self.durable,
                limit,
                limit,
                extra={"fields": {"durable": self.durable, "max_deliver": limit}},
            )

    async def _turn(self, client: Client, inbox: str) -> None:
        """Pull one batch, consume it, settle; after a failure, pause before the next pull."""
        nats = _nats()
        try:
            messages = await self._pull(client, inbox)
        except nats.errors.Error as exc:
            log.warning("fetching from NATS failed: %s", exc)
            await self.pause(self.backoff)
            return
        if not messages:
            return  # nothing to consume right now
        outcomes = await self._consume_in_progress(messages)
        await self._settle(messages, outcomes)
        await self.pause(self.retry_delay())

    async def _pull(self, client: Client, inbox: str) -> list[Msg]:
        """Up to a batch of deliveries: those at hand, else what the stream has now, else
        the first to come within FETCH_WAIT and whatever the stream has then."""
        if self._arrived:
            return self._take()
        # Each request ends on its own: a no_wait one once the stream has nothing more
        # (404, or 408 after some), a waiting one of one message with it or at its expiry.
        # A waiting request for a whole batch would hold its first message until the
        # batch fills or the request expires.
        await self._request(client, inbox, {"batch": self.batch, "no_wait": True}, 0.0)
        if not self._arrived:
            expires = int(FETCH_WAIT * 1e9)
            await self._request(client, inbox, {"batch": 1, "expires": expires}, FETCH_WAIT)
            if self._arrived and self.batch > 1:
                more = {"batch": self.batch - 1, "no_wait": True}
                await self._request(client, inbox, more, 0.0)
        return self._take()

    def _take(self) -> list[Msg]:
        """The deliveries at hand, up to a batch, in arrival order."""
        taken, self._arrived = self._arrived[: self.batch], self._arrived[self.batch :]
        return taken

    async def _request(
        self, client: Client, inbox: str, request: dict[str, int | bool], lasts: float
    ) -> None:
        """Make one pull request; return once it is answered in full, ended by the server,
        lost (no end within `lasts` + ANSWER_GRACE seconds), or stop() is called."""
        reply = f"{inbox}.{next(self._requests)}"
        wanted = len(self._arrived) + int(request["batch"])
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
        await client.publish(subject, json.dumps(request).encode(), reply=reply)
        deadline = time.monotonic() + lasts + ANSWER_GRACE
        stop = asyncio.ensure_future(self.wait_stopped())
        try:
            while reply not in self._ended and len(self._arrived) < wanted:
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping:
                    # Deliveries it may still bring are taken by a later turn.
                    log.debug("pull request %s had no end in time", reply)
                    return
                self._news.clear()
                news = asyncio.ensure_future(self._news.wait())
                await asyncio.wait({news, stop}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                news.cancel()
        finally:
            stop.cancel()
            self._ended.discard(reply)

    async def _receive(self, message: Msg) -> None:
        """Every message on the pull requests' inbox: a delivery, or the server's status."""
        if message.reply.startswith(ACK_PREFIX):
            # A delivery of the stream, whatever its headers say (a Status among them):
            # checked and settled like any other.
            self._arrived.append(message)
        else:
            # nats-py keys an inline status's description by an enum: lowercased makes
            # every name plain text.
            headers = lowercased(message.headers)
            status, described = headers.get("status", ""), headers.get("description", "")
            if status in ENDS_REQUEST:
                self._ended.add(message.subject)
                if status == "409":
                    # The request was refused (too many waiting, the durable deleted...).
                    log.warning("NATS ended a pull request: %s %s", status, described)
            elif status == "503":
                self._ended.add(message.subject)
                log.warning("NATS: no durable %s on stream %s answers", self.durable, self.stream)
            else:
                # Not a JetStream delivery nor a status that concerns us: someone else
                # published to this inbox. Nothing to settle.
                log.warning(
                    "ignored a message on the consumer's inbox that is not a JetStream "
                    "delivery (status %r)",
                    status[:20],
                )
        self._news.set()

    async def _watch(self, jetstream: JetStreamContext) -> None:
        """Read the durable every stall_after / 4 seconds: its pending counts to the metrics,
        and a warning when it has work but stopped advancing for stall_after seconds."""
        nats = _nats()
        metrics = self.metrics
        floor: int | None = None
        settled = self._settled
        since = time.monotonic()
        stalled = False
        while True:
            await self.pause(self.stall_after / 4)  # a stop ends it early
            if self.stopping:
                return
            try:
                info = await jetstream.consumer_info(self.stream, self.durable)
            except (nats.errors.Error, TimeoutError) as exc:
                log.debug("reading durable %s failed: %s", self.durable, exc)
                continue
            pending, ack_pending = info.num_pending or 0, info.num_ack_pending or 0
            metrics.durable_pending.set(pending)
            metrics.durable_ack_pending.set(ack_pending)
            now_floor = info.ack_floor.stream_seq if info.ack_floor else None
            now = time.monotonic()
            if pending + ack_pending == 0 or now_floor != floor or self._settled != settled:
                since = now
                if stalled:
                    stalled = False
                    metrics.durable_stalled.set(0)
                    log.info("durable %s advances again", self.durable)
            elif not stalled and now - since >= self.stall_after:
                stalled = True
                metrics.durable_stalled.set(1)
                log.warning(
                    "durable %s on stream %s has not advanced for %.0f s: %d message(s) to "
                    "deliver, %d delivered and unacknowledged (max_ack_pending %s)",
                    self.durable,
                    self.stream,
                    now - since,
                    pending,
                    ack_pending,
                    info.config.max_ack_pending,
                    extra={"fields": {"stream": self.stream, "durable": self.durable}},
                )
            floor, settled = now_floor, self._settled

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
        nats = _nats()
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
