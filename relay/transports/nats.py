"""NATS JetStream: each message published to the destination's stream, its PubAck the ACK.

A message goes to the subject its destination's template names, with
`Nats-Msg-Id` = an id derived from the reply_id with the destination's secret (the
reply_id itself when unsigned: relay.transports.nats_headers), the body bytes unchanged
and the broker headers (relay.transports.broker_headers). The PubAck is the trusted ACK,
a duplicate one too: the stream already holds that id, which only holders of the secret
can compute.
A parcel's messages are published together and each is settled by its own PubAck
(docs/explanation/contract.md#nats-jetstream), except that a key's later messages in a
parcel are each published only after the PubAck of the one before: a retried message
can never be stored behind its key's next.

A lost connection ends every publish still waiting as a retry, never as sent:
the stream may or may not have stored it, and the resend is dropped by the
stream's duplicate window if it had. The next parcel connects anew.

The destination's options (NatsOptions) choose the client: the relay's fast one
(relay.transports.nats_client), or nats-py's own with `fast_client = false`; both
publish the same bytes and settle each message by its own PubAck.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from outbox.durations import duration_text
from outbox.errors import ConfigError
from outbox.reserved_headers import NATS
from relay.destination import Destination, KindOptions, Reader, flag, text
from relay.errors import TransportError
from relay.policy import HELD, Dead, Outcome, Retry, Sent, retains, truncate
from relay.records import Message, first_of_each_key
from relay.transports.base import Parcel, Transport, check_template, clients
from relay.transports.nats_client import relay_client
from relay.transports.nats_connection import (
    SETUP_HINT,
    Answers,
    Link,
    PubAckReader,
    connect,
    describe,
    duplicate_window,
    short_window,
)
from relay.transports.nats_headers import NatsHeaders
from relay.transports.nats_wire import (
    BadHeaderName,
    Publish,
    check_stream_name,
    publish_all,
    render_subject,
)

log = logging.getLogger("outbox.relay")

CLIENT_MODULES = ("nats",)
"""The client the nats extra installs (pyproject.toml)."""


@dataclass(frozen=True)
class NatsOptions(KindOptions):
    """What a NATS destination has besides the common keys (docs/reference/config.md)."""

    KIND: ClassVar[str] = "nats"
    URL_SCHEMES: ClassVar[tuple[str, ...]] = ("nats", "tls")
    KEYS: ClassVar[Mapping[str, Reader]] = {"stream": text, "subject": text, "fast_client": flag}

    stream: str
    """The JetStream stream the subject belongs to (checked at start)."""
    subject: str
    """The subject to publish on; a template that may name {ordering_key}."""
    fast_client: bool = True
    """Publish through the relay's fast client (relay.transports.nats_client), which
    overrides nats-py internals; false: through nats-py's own publish, slower."""

    def __post_init__(self) -> None:
        check_stream_name(self.stream)
        check_template("subject", self.subject)
        if any(c in self.subject for c in " \t\r\n"):
            # The relay publishes without the client's per-message subject check.
            raise ConfigError(f"subject {self.subject!r} must not hold spaces, tabs or line breaks")


class NatsTransport(Transport):
    """Publishes to one JetStream stream over one connection, made on first use.

    Publishes ask for their PubAck on one reply subscription per connection and
    a parcel waits for all of them at once, within the destination's timeout:
    several times fewer CPU cycles per message than a request (and a timer) each.
    """

    MESSAGING_SYSTEM = "nats"

    def __init__(self, destination: Destination) -> None:
        """Nothing connects until the first publish or retention check."""
        super().__init__(destination)
        [self._nats] = clients("nats", CLIENT_MODULES)
        options = destination.options
        if not isinstance(options, NatsOptions):
            raise ConfigError(f"a nats destination has NatsOptions, not {options!r}")
        self.options = options
        self.stream = options.stream
        self.subject = options.subject
        self._keyless_subject = render_subject(self.subject, None)
        """The subject of a message without an ordering key, and of every message when the
        template names none."""
        self._keyed = "{" in self.subject
        self._headers = NatsHeaders(destination, self.stream)
        self._answer = PubAckReader(self.stream)
        self._link: Link | None = None
        self._connecting = asyncio.Lock()
        self._required_window: float | None = None
        """A duplicate window to check for before publishing: the start check could not."""

    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """Up to max_batch_items messages per parcel, published together."""
        size = self.destination.max_batch_items
        return [Parcel(messages[i : i + size]) for i in range(0, len(messages), size)]

    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """Publish every message of the parcel at once; each outcome from its own PubAck.

        One deadline, the destination's timeout, bounds the whole attempt: waiting for
        the connection, connecting, publishing (a flush on a stalled socket) and the
        PubAcks. Whatever is not acknowledged by then is a retry.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.destination.timeout
        try:
            async with asyncio.timeout_at(deadline):
                link = await self._connection()
                refusal = await self._unmet_window(link)
        except (OSError, TimeoutError, TransportError, self._nats.errors.Error) as exc:
            if isinstance(exc, TimeoutError) and loop.time() >= deadline:
                reason = f"no connection to NATS within {self.destination.timeout:g}s"
            else:
                reason = truncate(f"cannot connect to NATS: {describe(exc)}")
            return dict.fromkeys((m.id for m in parcel.messages), Retry(None, reason))
        if refusal is not None:
            return dict.fromkeys((m.id for m in parcel.messages), Retry(None, refusal))
        # Each id once: a message given twice is answered by whichever PubAck comes first.
        answers = Answers(loop, len({m.id for m in parcel.messages}))
        tokens: list[str] = []
        expired = False
        signed_at = int(time.time())  # one reading of the clock for the parcel's signatures
        # A key's later messages wait for the PubAck of the one before (see _follow).
        first, later = first_of_each_key(parcel.messages)
        held_back = {m.id for chain in later.values() for m in chain}
        try:
            async with asyncio.timeout_at(deadline):
                publishes: list[Publish] = []
                for message in first:
                    prepared = self._prepared(link, answers, tokens, message, signed_at)
                    if isinstance(prepared, Publish):
                        publishes.append(prepared)
                    else:
                        answers.record(message.id, prepared)
                    if message.ordering_key in later:
                        answers.watched[message.id] = loop.create_future()
                await self._publish(link, publishes, answers)
                follow = (
                    self._follow(link, answers, tokens, chain, signed_at, held_back)
                    for chain in [
                        [m, *later[m.ordering_key]] for m in first if m.ordering_key in later
                    ]
                )
                await asyncio.gather(*follow)
                await self._wait(link, answers)
        except TimeoutError:
            expired = True
        finally:
            for token in tokens:
                link.waiting.pop(token, None)
        outcomes = answers.outcomes
        for message in parcel.messages:
            if message.id not in outcomes:
                # The deadline came before its publish or its PubAck, or the link was lost;
                # a key's message that was never published is held back, not attempted.
                unanswered = HELD if message.id in held_back else self._unanswered(link)
                outcomes[message.id] = unanswered
        if expired:
            # Silence past the deadline may be a half-open connection: the next attempt
            # connects anew rather than publish into it again.
            link.lost.set()
        return outcomes

    def _prepared(
        self,
        link: Link,
        answers: Answers,
        tokens: list[str],
        message: Message,
        signed_at: int,
    ) -> Publish | Outcome:
        """_prepare under a new reply token that `answers` waits on."""
        token = str(next(link.tokens))
        link.waiting[token] = (answers, message.id)
        tokens.append(token)
        return self._prepare(link, message, token, signed_at)

    async def _follow(
        self,
        link: Link,
        answers: Answers,
        tokens: list[str],
        chain: list[Message],
        signed_at: int,
        held_back: set[int],
    ) -> None:
        """Publish a key's later messages of the parcel, each after the PubAck of the one
        before: a retry of one can then never land behind the next. A message that ends
        neither sent nor dead stops the key (the rest are HELD); a dead one does not."""
        for index, message in enumerate(chain):
            if index > 0:
                answers.watched[message.id] = asyncio.get_running_loop().create_future()
                held_back.discard(message.id)
                prepared = self._prepared(link, answers, tokens, message, signed_at)
                if isinstance(prepared, Publish):
                    await self._publish(link, [prepared], answers)
                else:
                    answers.record(message.id, prepared)
            watch = answers.watched.get(message.id)
            if watch is not None and message.id not in answers.outcomes:
                lost: asyncio.Future[Any] = asyncio.ensure_future(link.lost.wait())
                try:
                    await asyncio.wait({watch, lost}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    lost.cancel()
            if not isinstance(answers.outcomes.get(message.id), Sent | Dead):
                for rest in chain[index + 1 :]:
                    answers.record(rest.id, HELD)
                return

    def _prepare(
        self, link: Link, message: Message, token: str, signed_at: int
    ) -> Publish | Outcome:
        """The publish of one message asking for its PubAck, or why it cannot go out."""
        # Stripped as the block writes it: " Nats-Rollup" would go out as Nats-Rollup.
        reserved = [
            n for n in message.headers if any(reservation.covers(n.strip()) for reservation in NATS)
        ]
        if reserved:
            # Stored before publish() refused such names: JetStream or the consumer's
            # client would act on them.
            return Dead(None, f"header {reserved[0]!r} is reserved for NATS")
        try:
            block = self._headers.build(message, signed_at)
        except BadHeaderName as exc:
            return Dead(None, truncate(f"NATS refused the message: {exc}"))
        except (ValueError, TypeError, AttributeError) as exc:
            # A row no publish() stores (a reply_id that cannot be signed, a header value
            # that is not text or not encodable): no resend can change it.
            return Dead(None, truncate(f"message cannot be published to NATS: {exc!r}"))
        size = len(message.body) + len(block.block)
        if size > link.client.max_payload:
            # The server would drop the connection over it, and every resend again.
            return Dead(
                None,
                f"message of {size} bytes (body and headers) exceeds the NATS server's "
                f"max_payload of {link.client.max_payload} bytes",
            )
        key = message.ordering_key
        if key is None or not self._keyed:
            subject = self._keyless_subject
        else:
            subject = render_subject(self.subject, key)
        if not subject:
            # "HPUB  <reply> ..." would publish the message to the relay's own inbox.
            return Dead(None, "NATS refused the message: empty subject")
        return Publish(subject, f"{link.inbox}.{token}", message.body, block, message.id)

    async def _publish(self, link: Link, publishes: list[Publish], answers: Answers) -> None:
        """Publish them all; when that fails, each is a retry (a resend of one that got
        through is dropped by the stream's duplicate window)."""
        try:
            await publish_all(link.client, publishes)
        except (OSError, self._nats.errors.Error) as exc:
            failed = Retry(None, truncate(f"NATS publish failed: {describe(exc)}"))
            for publish in publishes:
                answers.record(publish.message_id, failed)

    async def _wait(self, link: Link, answers: Answers) -> None:
        """Until every PubAck of the parcel is in or the connection is lost; the caller's
        deadline ends the wait."""
        if answers.all_in.done():
            return
        watch: asyncio.Future[Any] = asyncio.ensure_future(link.lost.wait())
        try:
            # asyncio.wait leaves all_in as it is when the deadline cancels this wait.
            await asyncio.wait({answers.all_in, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()

    def _unanswered(self, link: Link) -> Retry:
        if link.lost.is_set():
            return Retry(None, "connection to NATS lost before the PubAck")
        return Retry(None, f"no PubAck within {self.destination.timeout:g}s")

    async def _connection(self) -> Link:
        """The open connection, or a new one when there is none or it was lost."""
        async with self._connecting:
            link = self._link
            if link is not None and link.client.is_connected and not link.lost.is_set():
                return link
            if link is not None and not link.client.is_closed:
                await link.client.close()
            self._link = link = await self._connect()
            return link

    async def _connect(self) -> Link:
        # The fast client checks nats-py's internals at first use, and falls back to
        # nats-py's own client when they are not the ones it knows.
        fast = self.options.fast_client
        client_class = relay_client(self._nats) if fast else self._nats.aio.client.Client
        destination = self.destination
        return await connect(client_class, destination.url, destination.timeout, self._answer)

    async def holds(self, message: Message) -> bool | None:
        """Cannot say: JetStream looks up a Nats-Msg-Id only as a publish's duplicate check."""
        return None

    def check_retention_later(self, required: float) -> None:
        """The start check could not read the stream: read it before the first publish."""
        self._required_window = required

    async def _unmet_window(self, link: Link) -> str | None:
        """Why nothing may be published yet (the stream as the start check would refuse
        it), or None; read on each attempt until the stream passes once."""
        required = self._required_window
        if required is None:
            return None
        try:
            window = await self._duplicate_window(link)
        except ConfigError as exc:
            refusal = f"{exc}; nothing is published until that is fixed"
        else:
            if retains(window, required):
                self._required_window = None
                log.info(
                    "NATS stream %s: duplicate window %s checked",
                    self.stream,
                    duration_text(window),
                )
                return None
            why = (
                f"NATS destination: stream {self.stream!r} keeps a duplicate window of "
                f"{duration_text(window)}, shorter than the longest retry window "
                f"({duration_text(required)}): a resend could be stored twice"
            )
            if self.destination.allow_short_retention:
                self._required_window = None
                log.warning("%s (allow_short_retention is set)", why)
                return None
            needed = duration_text(math.ceil(required))
            refusal = (
                f"{why}; nothing is published until its duplicate_window is at least "
                f"{needed} ({SETUP_HINT}), or allow_short_retention is set"
            )
        log.error("%s", refusal, extra={"fields": {"stream": self.stream}})
        return truncate(refusal)

    async def retention(self) -> float | None:
        """The stream's duplicate window (seconds), after checking it captures the subject.

        ConfigError when the stream does not exist, does not capture the subject, or
        does not acknowledge publishes; TransportError when NATS cannot be reached.
        """
        try:
            link = await self._connection()
        except (OSError, TimeoutError, self._nats.errors.Error) as exc:
            raise TransportError(f"NATS stream {self.stream!r} not read: {describe(exc)}") from exc
        return await self._duplicate_window(link)

    async def _duplicate_window(self, link: Link) -> float:
        """retention() on an open connection."""
        url = self.destination.url
        return await duplicate_window(self._nats, link, self.stream, self.subject, url)

    def too_short(self, name: str, kept: float, longest: float) -> str:
        """The stream's duplicate window is what keeps receipts: raise it, or run regardless."""
        return short_window(name, self.stream, kept, longest)

    async def close(self) -> None:
        """Close the connection, if one is open."""
        link, self._link = self._link, None
        if link is not None:
            link.lost.set()  # ours to close: not a lost connection to warn of
            if not link.client.is_closed:
                await link.client.close()
