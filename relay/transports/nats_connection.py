"""One NATS connection of the relay: connecting, the PubAcks its publishes wait for, and
the stream it publishes to, read.

A connection never reconnects inside the client: a lost one ends every publish still
waiting as a retry (relay.transports.nats), and the next parcel connects anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from outbox.durations import duration_text
from outbox.errors import ConfigError
from outbox.redaction import redact, redact_urls
from relay.errors import TransportError
from relay.policy import ACKED, Dead, Outcome, Retry, truncate
from relay.transports.nats_wire import render_subject, subject_matches, subscribe_answers

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

log = logging.getLogger("outbox.relay")

# JetStream answers 400 to what no resend can change: the subject bound to another
# stream than the configured one, a message or its headers over the stream's limit.
_PERMANENT_CODES = frozenset({400})

SETUP_HINT = "`outbox broker setup` creates or updates the stream to fit"
"""How to fix a stream the relay refuses (outbox_cli.broker)."""


def short_window(name: str, stream: str, kept: float, longest: float) -> str:
    """Why destination `name` is refused for its stream's duplicate window of `kept`
    seconds, shorter than the `longest` retry window, and the two fixes."""
    needed = duration_text(math.ceil(longest))
    return (
        f"destination {name!r}: stream {stream!r} keeps a duplicate window of "
        f"{duration_text(kept)}, shorter than the longest retry window "
        f"({duration_text(longest)}): a late resend could be stored twice. Raise the "
        f"stream's duplicate_window to at least {needed} (`outbox broker setup` does), or "
        "set allow_short_retention = true to run regardless"
    )


class Answers:
    """One parcel's outcomes as its PubAcks come in, and one future for the last of them.

    One future per parcel, not per message: a future, its done callback and the loop
    turn that runs it cost more per message than reading the PubAck does.
    """

    __slots__ = ("all_in", "left", "outcomes", "watched")

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        """Waiting for `count` outcomes."""
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


class Link:
    """One connection, and the PubAcks its publishes wait for, by reply token."""

    def __init__(self, client: Client, inbox: str, timeout: float) -> None:
        """A connected client, and the inbox its PubAcks come to."""
        self.client = client
        self.js: JetStreamContext = client.jetstream(timeout=timeout)
        self.inbox = inbox
        """Each publish asks for its PubAck on `<inbox>.<token>`."""
        self.waiting: dict[str, tuple[Answers, int]] = {}
        """By reply token: the parcel waiting for that PubAck, and the message's id."""
        self.lost = asyncio.Event()
        self.tokens = itertools.count()


class PubAckReader:
    """Reads JetStream's answers to publishes into one stream."""

    def __init__(self, stream: str) -> None:
        """The reader of `stream`'s PubAcks."""
        self.stream = stream
        self.prefix = b'{"stream":%s,' % json.dumps(stream).encode()
        """How nats-server starts a PubAck of this stream when JSON and Go quote its name
        alike (printable ASCII); an error answer never starts so. Other acks parse in full."""

    def __call__(self, data: bytes, headers: Mapping[str, str] | None) -> Outcome:
        """JetStream's answer to one publish: PubAck sent; transient retry; permanent dead."""
        if headers and headers.get("Status") == "503":
            # No stream listens on the subject now: in a cluster while a stream leader is
            # elected, or while a server restarts; a stream deleted for good goes dead
            # when the retry budget is spent, with this reason.
            return Retry(None, "no JetStream stream answered on the subject (missing or not ready)")
        if data.startswith(self.prefix):
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


AnswerReader = Callable[[bytes, Mapping[str, str] | None], Outcome]
"""Reads JetStream's answer to one publish (its data and headers) as the message's outcome."""


async def connect(client_class: type, url: str, timeout: float, read: AnswerReader) -> Link:
    """A new connection with `client_class` (nats-py's Client or the relay's fast one),
    its answers read by `read` as they come."""
    shown = redact_urls(url)
    lost = asyncio.Event()

    async def on_lost() -> None:
        if not lost.is_set():
            log.warning("NATS connection to %s lost", shown)
        lost.set()

    async def on_error(exc: Exception) -> None:
        # Each failed connect says so too: its parcel's messages retry with this.
        log.info("NATS connection to %s: %s", shown, describe(exc))

    # No reconnecting inside the client: it would buffer publishes and send them
    # after the relay counted them as retries. A lost connection is closed, its
    # waiting publishes are retries, and the next parcel connects again.
    client = client_class()
    connecting = client.connect(
        url,
        allow_reconnect=False,
        # The client's first connect loops over its server list this many times.
        max_reconnect_attempts=1,
        reconnect_time_wait=0,
        connect_timeout=timeout,
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
    link = Link(client, client.new_inbox(), timeout)
    link.lost = lost

    def on_answer(token: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        waiting = link.waiting.pop(token, None)
        if waiting is not None:
            answers, message_id = waiting
            try:
                outcome = read(data, headers)
            except Exception:  # noqa: BLE001 - any answer this cannot read is a retry
                outcome = Retry(None, truncate(f"unreadable JetStream answer: {data[:200]!r}"))
            answers.record(message_id, outcome)

    await subscribe_answers(client, link.inbox, on_answer)
    return link


async def duplicate_window(nats: Any, link: Link, stream: str, subject: str, url: str) -> float:
    """The duplicate window (seconds) of `stream`, after checking it captures `subject`
    (a template) and acknowledges publishes: ConfigError when not; TransportError when
    it cannot be read."""
    try:
        info = await link.js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        raise ConfigError(
            f"NATS destination: stream {stream!r} does not exist on "
            f"{redact_urls(url)}; {SETUP_HINT}"
        ) from None
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise TransportError(f"NATS stream {stream!r} not read: {describe(exc)}") from exc
    config = info.config
    sample = render_subject(subject, None)
    if not any(subject_matches(f, sample) for f in _subjects(config.subjects)):
        raise ConfigError(
            f"NATS destination: stream {stream!r} (subjects {config.subjects}) does "
            f"not capture the subject {subject!r} (as {sample!r}); {SETUP_HINT}"
        )
    if config.no_ack:
        raise ConfigError(
            f"NATS destination: stream {stream!r} has no_ack set: it sends no PubAck, "
            "and a PubAck is what marks a message sent"
        )
    return float(config.duplicate_window or 0)


def _subjects(subjects: Iterable[str] | None) -> list[str]:
    return list(subjects or ())


def describe(exc: BaseException) -> str:
    """An error's class and text, with URL credentials and secrets hidden."""
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
