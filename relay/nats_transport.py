"""NATS JetStream: each message published to the destination's stream, its PubAck the ACK.

A message goes to the subject its destination's template names, with
`Nats-Msg-Id` = an id derived from the reply_id with the destination's secret (the
reply_id itself when unsigned: relay.nats_headers), the body bytes unchanged and the
broker headers (relay.broker_headers). The PubAck is the trusted ACK, a duplicate one
too: the stream already holds that id, which only holders of the secret can compute.
A parcel's messages are published together and each is settled by its own PubAck
(docs/explanation/contract.md#nats-jetstream), except that a key's later messages in a
parcel are each published only after the PubAck of the one before: a retried message
can never be stored behind its key's next.

A lost connection ends every publish still waiting as a retry, never as sent:
the stream may or may not have stored it, and the resend is dropped by the
stream's duplicate window if it had. The next parcel connects anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from outbox.durations import duration_text
from outbox.errors import ConfigError, TransportError
from outbox.messages import NATS_STATUS_HEADERS, RESERVED_HEADER_PREFIX
from outbox.redaction import redact, redact_urls
from relay.config import Destination
from relay.nats_headers import NatsHeaders
from relay.nats_wire import BadHeaderName, Publish, publish_all, relay_client, subscribe_answers
from relay.policy import ACKED, HELD, Dead, Outcome, Retry, Sent, retains, truncate
from relay.records import Message, key_chains
from relay.transport import Parcel, Transport, clients

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

log = logging.getLogger("outbox.relay")

NO_KEY_TOKEN = "_"  # noqa: S105 - a subject token, not a password
"""The subject token of a message without an ordering key."""
_KEEP = frozenset(chr(c) for c in range(0x21, 0x7F)) - set(".*>%")
"""Characters an ordering key keeps in a subject token; all others are percent-encoded."""
# JetStream answers 400 to what no resend can change: the subject bound to another
# stream than the configured one, a message or its headers over the stream's limit.
_PERMANENT_CODES = frozenset({400})
SETUP_HINT = "`outbox broker setup` creates or updates the stream to fit"
"""How to fix a stream the relay refuses (outbox_cli.broker)."""


def subject_token(ordering_key: str | None) -> str:
    """The ordering key as one NATS subject token (docs/explanation/contract.md#nats-jetstream).

    Space, '.', '*', '>', '%', control and non-ASCII characters become %XX (each
    UTF-8 byte, upper-case hex); no key is `_`, and the key `_` itself is %5F,
    so different keys never share a token.
    """
    if ordering_key is None:
        return NO_KEY_TOKEN
    if ordering_key == NO_KEY_TOKEN:
        return "%5F"
    return "".join(
        c if c in _KEEP else "".join(f"%{b:02X}" for b in c.encode()) for c in ordering_key
    )


def render_subject(template: str, ordering_key: str | None) -> str:
    """The subject a message is published on: the template with its ordering key token."""
    return template.format(ordering_key=subject_token(ordering_key))


def subject_matches(filter_subject: str, subject: str) -> bool:
    """Whether a stream's subject filter (with * and > wildcards) captures `subject`."""
    wanted, tokens = filter_subject.split("."), subject.split(".")
    for index, part in enumerate(wanted):
        if part == ">":
            return len(tokens) > index
        if index >= len(tokens) or (part != "*" and part != tokens[index]):
            return False
    return len(tokens) == len(wanted)


class _Answers:
    """One parcel's outcomes as its PubAcks come in, and one future for the last of them.

    One future per parcel, not per message: a future, its done callback and the loop
    turn that runs it cost more per message than reading the PubAck does.
    """

    __slots__ = ("all_in", "left", "outcomes", "watched")

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self.outcomes: dict[int, Outcome] = {}
        """By message id: the PubAck's reading, or why the message could not go out."""
        self.watched: dict[int, asyncio.Future[None]] = {}
        """Messages whose key's next message waits for their outcome: set when it comes."""
        self.left = count
        self.all_in: asyncio.Future[None] = loop.create_future()
        if count == 0:
            self.all_in.set_result(None)

    def record(self, message_id: int, outcome: Outcome) -> None:
        """The outcome of one message of the parcel; the first one for it holds."""
        if message_id in self.outcomes:
            return
        self.outcomes[message_id] = outcome
        watch = self.watched.pop(message_id, None) if self.watched else None
        if watch is not None and not watch.done():
            watch.set_result(None)
        self.left -= 1
        if self.left == 0 and not self.all_in.done():
            self.all_in.set_result(None)


class _Link:
    """One connection, and the PubAcks its publishes wait for, by reply token."""

    def __init__(self, client: Client, inbox: str, timeout: float) -> None:
        self.client = client
        self.js: JetStreamContext = client.jetstream(timeout=timeout)
        self.inbox = inbox
        """Each publish asks for its PubAck on `<inbox>.<token>`."""
        self.waiting: dict[str, tuple[_Answers, int]] = {}
        """By reply token: the parcel waiting for that PubAck, and the message's id."""
        self.lost = asyncio.Event()
        self.tokens = itertools.count()


class NatsTransport(Transport):
    """Publishes to one JetStream stream over one connection, made on first use.

    Publishes ask for their PubAck on one reply subscription per connection and
    a parcel waits for all of them at once, within the destination's timeout:
    several times fewer CPU cycles per message than a request (and a timer) each.
    """

    def __init__(self, destination: Destination) -> None:
        """Nothing connects until the first publish or retention check."""
        super().__init__(destination)
        [self._nats] = clients("nats")
        if destination.stream is None or destination.subject is None:
            raise ConfigError("a destination of kind nats needs stream and subject")
        self.stream = destination.stream
        self.subject = destination.subject
        self._keyless_subject = render_subject(self.subject, None)
        """The subject of a message without an ordering key, and of every message when the
        template names none."""
        self._keyed = "{" in self.subject
        self._headers = NatsHeaders(destination, self.stream)
        self._pub_ack_prefix = b'{"stream":%s,' % json.dumps(self.stream).encode()
        """How nats-server starts a PubAck of this stream when JSON and Go quote its name
        alike (printable ASCII); an error answer never starts so. Other acks parse in full."""
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()
        self._required_window: float | None = None
        """A duplicate window to check for before publishing: the start check could not."""

    @property
    def mode(self) -> str:
        """Metrics label this transport "nats"."""
        return "nats"

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
                reason = truncate(f"cannot connect to NATS: {_describe(exc)}")
            return dict.fromkeys((m.id for m in parcel.messages), Retry(None, reason))
        if refusal is not None:
            return dict.fromkeys((m.id for m in parcel.messages), Retry(None, refusal))
        # Each id once: a message given twice is answered by whichever PubAck comes first.
        answers = _Answers(loop, len({m.id for m in parcel.messages}))
        tokens: list[str] = []
        expired = False
        signed_at = int(time.time())  # one reading of the clock for the parcel's signatures
        # A key's later messages wait for the PubAck of the one before (see _follow).
        first, later = _first_of_each_key(parcel.messages)
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
        link: _Link,
        answers: _Answers,
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
        link: _Link,
        answers: _Answers,
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
        self, link: _Link, message: Message, token: str, signed_at: int
    ) -> Publish | Outcome:
        """The publish of one message asking for its PubAck, or why it cannot go out."""
        # Stripped as the block writes it: " Nats-Rollup" would go out as Nats-Rollup.
        reserved = [
            n
            for n in message.headers
            if n.strip().lower().startswith(RESERVED_HEADER_PREFIX)
            or n.strip().lower() in NATS_STATUS_HEADERS
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

    async def _publish(self, link: _Link, publishes: list[Publish], answers: _Answers) -> None:
        """Publish them all; when that fails, each is a retry (a resend of one that got
        through is dropped by the stream's duplicate window)."""
        try:
            await publish_all(link.client, publishes)
        except (OSError, self._nats.errors.Error) as exc:
            failed = Retry(None, truncate(f"NATS publish failed: {_describe(exc)}"))
            for publish in publishes:
                answers.record(publish.message_id, failed)

    async def _wait(self, link: _Link, answers: _Answers) -> None:
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

    def _unanswered(self, link: _Link) -> Retry:
        if link.lost.is_set():
            return Retry(None, "connection to NATS lost before the PubAck")
        return Retry(None, f"no PubAck within {self.destination.timeout:g}s")

    def _answer(self, data: bytes, headers: Mapping[str, str] | None) -> Outcome:
        """JetStream's answer to one publish: PubAck sent; transient retry; permanent dead."""
        if headers and headers.get("Status") == "503":
            # No stream listens on the subject now: in a cluster while a stream leader is
            # elected, or while a server restarts; a stream deleted for good goes dead
            # when the retry budget is spent, with this reason.
            return Retry(None, "no JetStream stream answered on the subject (missing or not ready)")
        if data.startswith(self._pub_ack_prefix):
            # A PubAck of this stream, duplicate or not: an error answer starts with
            # {"error", so one that starts so carries none. Anything else is read in full.
            return ACKED
        try:
            answer = json.loads(data)
            error = answer.get("error")
        except (ValueError, AttributeError):
            return Retry(None, truncate(f"unreadable JetStream answer: {data[:200]!r}"))
        if error is None:
            if answer.get("stream") != self.stream:
                return Retry(None, truncate(f"unreadable JetStream answer: {data[:200]!r}"))
            return ACKED  # a PubAck, duplicate or not: the stream holds the reply_id
        code = error.get("code") if isinstance(error, dict) else None
        said = truncate(f"JetStream refused the message: {error}")
        permanent = isinstance(code, int) and code in _PERMANENT_CODES
        return Dead(None, said) if permanent else Retry(None, said)

    async def _connection(self) -> _Link:
        """The open connection, or a new one when there is none or it was lost."""
        async with self._connecting:
            link = self._link
            if link is not None and link.client.is_connected and not link.lost.is_set():
                return link
            if link is not None and not link.client.is_closed:
                await link.client.close()
            self._link = link = await self._connect()
            return link

    async def _connect(self) -> _Link:
        url = redact_urls(self.destination.url)
        lost = asyncio.Event()

        async def on_lost() -> None:
            if not lost.is_set():
                log.warning("NATS connection to %s lost", url)
            lost.set()

        async def on_error(exc: Exception) -> None:
            # Each failed connect says so too: its parcel's messages retry with this.
            log.info("NATS connection to %s: %s", url, _describe(exc))

        # No reconnecting inside the client: it would buffer publishes and send them
        # after the relay counted them as retries. A lost connection is closed, its
        # waiting publishes are retries, and the next parcel connects again.
        client = relay_client(self._nats)()
        connecting = client.connect(
            self.destination.url,
            allow_reconnect=False,
            # The client's first connect loops over its server list this many times.
            max_reconnect_attempts=1,
            reconnect_time_wait=0,
            connect_timeout=self.destination.timeout,
            closed_cb=on_lost,
            disconnected_cb=on_lost,
            error_cb=on_error,
            name="outbox-relay",
            # Subjects are the relay's own: the template is checked at start and an
            # ordering key is percent-encoded into one token (no space, CR or LF).
            skip_subject_validation=True,
        )
        try:
            await connecting
        except BaseException:
            # Failed or cut short by the attempt's deadline: close what it opened (never
            # connected: not a lost connection to warn of).
            lost.set()
            with contextlib.suppress(Exception):
                await client.close()
            raise
        link = _Link(client, client.new_inbox(), self.destination.timeout)
        link.lost = lost

        def on_answer(token: str, data: bytes, headers: Mapping[str, str] | None) -> None:
            waiting = link.waiting.pop(token, None)
            if waiting is not None:
                answers, message_id = waiting
                try:
                    outcome = self._answer(data, headers)
                except Exception:  # noqa: BLE001 - any answer this cannot read is a retry
                    outcome = Retry(None, truncate(f"unreadable JetStream answer: {data[:200]!r}"))
                answers.record(message_id, outcome)

        await subscribe_answers(client, link.inbox, on_answer)
        return link

    async def holds(self, message: Message) -> bool | None:
        """Cannot say: JetStream looks up a Nats-Msg-Id only as a publish's duplicate check."""
        return None

    def check_retention_later(self, required: float) -> None:
        """The start check could not read the stream: read it before the first publish."""
        self._required_window = required

    async def _unmet_window(self, link: _Link) -> str | None:
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
            raise TransportError(f"NATS stream {self.stream!r} not read: {_describe(exc)}") from exc
        return await self._duplicate_window(link)

    async def _duplicate_window(self, link: _Link) -> float:
        """retention() on an open connection."""
        nats = self._nats
        try:
            info = await link.js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            raise ConfigError(
                f"NATS destination: stream {self.stream!r} does not exist on "
                f"{redact_urls(self.destination.url)}; {SETUP_HINT}"
            ) from None
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise TransportError(f"NATS stream {self.stream!r} not read: {_describe(exc)}") from exc
        config = info.config
        sample = render_subject(self.subject, None)
        if not any(subject_matches(f, sample) for f in _subjects(config.subjects)):
            raise ConfigError(
                f"NATS destination: stream {self.stream!r} (subjects {config.subjects}) does "
                f"not capture the subject {self.subject!r} (as {sample!r}); {SETUP_HINT}"
            )
        if config.no_ack:
            raise ConfigError(
                f"NATS destination: stream {self.stream!r} has no_ack set: it sends no PubAck, "
                "and a PubAck is what marks a message sent"
            )
        return float(config.duplicate_window or 0)

    async def close(self) -> None:
        """Close the connection, if one is open."""
        link, self._link = self._link, None
        if link is not None:
            link.lost.set()  # ours to close: not a lost connection to warn of
            if not link.client.is_closed:
                await link.client.close()


def _first_of_each_key(
    messages: Sequence[Message],
) -> tuple[list[Message], dict[str | None, list[Message]]]:
    """The messages published at once (every unkeyed one and the first of each key), and
    each key's later ones, in order."""
    chains = key_chains(messages)
    later = {chain[0].ordering_key: chain[1:] for chain in chains if len(chain) > 1}
    return [chain[0] for chain in chains], later


def _subjects(subjects: Iterable[str] | None) -> list[str]:
    return list(subjects or ())


def _describe(exc: BaseException) -> str:
    """An error's class and text, with URL credentials and secrets hidden."""
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
