"""Broker setup: the JetStream stream, or the RabbitMQ exchange and queue, a destination needs.

The relay refuses to start when a NATS destination's stream is missing, does not
capture its subject, or keeps a duplicate window shorter than the relay's retry
window, and when a RabbitMQ destination's exchange is missing. Setting up creates
what is missing and raises what is too small; it never shrinks or deletes
anything. What could only be fixed by destroying something is refused, with the
reason. Run twice, the second run changes nothing and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import string
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from outbox.clients import optional_client
from outbox.errors import ConfigError
from outbox.redaction import redact, redact_urls
from relay.destination import Destination
from relay.errors import SetupRefused, TransportError
from relay.policy import retains
from relay.transports.nats import NatsOptions
from relay.transports.nats_wire import render_subject, subject_matches
from relay.transports.rabbitmq import RabbitMqOptions

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection
    from nats.aio.client import Client
    from nats.js.api import StreamConfig

Action = Literal["created", "updated", "unchanged", "ensured", "nothing to set up"]
EXCHANGE_TYPES = ("topic", "direct", "fanout", "headers")
"""The exchange types setup declares; topic by default, the one a template's wildcard fits."""
DEFAULT_EXCHANGE_TYPE = "topic"
_SUBJECTS_OVERLAP = 10065
"""JetStream's error code for subjects that another stream already captures."""
_FIELD = "\x00"
"""Stands for a template field while its tokens are found: no template holds a NUL."""


@dataclass(frozen=True)
class Change:
    """One thing on a broker, and what setup did to it (or, in a dry run, would do)."""

    thing: str
    action: Action
    detail: str = ""

    def line(self, dry_run: bool = False) -> str:
        """`thing: action (detail)`; in a dry run, `would be created` and the like."""
        done = (
            f"would be {self.action}"
            if dry_run and self.action in ("created", "updated", "ensured")
            else self.action
        )
        return f"{self.thing}: {done}" + (f" ({self.detail})" if self.detail else "")


def _with_wildcards(template: str, wildcard: str) -> str:
    """The template with each dot-separated token that holds a field replaced by `wildcard`."""
    text = "".join(
        literal + ("" if field is None else _FIELD)
        for literal, field, _, _ in string.Formatter().parse(template)
    )
    return ".".join(wildcard if _FIELD in token else token for token in text.split("."))


def stream_subject(template: str) -> str:
    """The subject filter that captures every subject a NATS subject template publishes on.

    An ordering key fills exactly one token (relay.transports.nats_wire.subject_token
    percent-encodes its dots), so each token holding {ordering_key} becomes `*`.
    """
    wanted = _with_wildcards(template, "*")
    sample = render_subject(template, None)
    if not subject_matches(wanted, sample):
        raise ConfigError(f"subject {template!r}: no stream subject captures it as {sample!r}")
    return wanted


def binding_key(template: str) -> str:
    """The topic binding key that matches every routing key a template produces.

    An ordering key goes into the routing key as it is, dots included, so it may
    fill several words: each word holding {ordering_key} becomes `#`.
    """
    return _with_wildcards(template, "#")


def covers(subject_filter: str, wanted: str) -> bool:
    """Whether a stream's subject filter captures every subject that `wanted` matches."""
    have, need = subject_filter.split("."), wanted.split(".")
    for index, part in enumerate(have):
        if part == ">":
            return len(need) > index
        if index >= len(need) or need[index] == ">":
            return False
        if part != "*" and part != need[index]:
            return False
    return len(need) == len(have)


def stream_changes(
    config: StreamConfig, wanted: str, window: float, allow_short: bool
) -> tuple[dict[str, Any], list[str]]:
    """What an existing stream needs (fields to update) and why, in words.

    SetupRefused when it conflicts in a way only a destructive change would fix.
    """
    name = config.name
    if config.no_ack:
        raise SetupRefused(
            f"NATS stream {name!r} has no_ack set: it sends no PubAck, and a PubAck is what "
            "marks a message sent; this command does not change it: unset no_ack yourself "
            "or give the destination a stream of its own"
        )
    changes: dict[str, Any] = {}
    said: list[str] = []
    subjects = list(config.subjects or ())
    if not any(covers(subject, wanted) for subject in subjects):
        # JetStream refuses overlapping filters in one stream: those the new one captures
        # go, and the stream captures every subject it did and more.
        replaced = [subject for subject in subjects if covers(wanted, subject)]
        changes["subjects"] = [s for s in subjects if s not in replaced] + [wanted]
        instead = f" in place of {', '.join(replaced)}" if replaced else ""
        said.append(f"subject {wanted} added{instead}")
    current = float(config.duplicate_window or 0)
    max_age = float(config.max_age or 0)
    if not retains(current, window):
        if max_age and not retains(max_age, window):
            # JetStream refuses a duplicate window longer than max_age, and keeping
            # messages longer is the stream owner's decision, not this command's.
            why = (
                f"NATS stream {name!r} keeps messages for {max_age:g}s (max_age), and its "
                f"duplicate window ({current:g}s) cannot be raised past that to the relay's "
                f"retry window ({window:g}s)"
            )
            if not allow_short:
                raise SetupRefused(
                    f"{why}: raise its max_age, or set allow_short_retention on the destination"
                )
            said.append(f"duplicate window {current:g}s kept: allow_short_retention is set")
        else:
            changes["duplicate_window"] = whole_seconds(window)
            said.append(f"duplicate window {current:g}s -> {whole_seconds(window)}s")
    return changes, said


def whole_seconds(window: float) -> int:
    """The duplicate window to set for a retry window: whole seconds, rounded up, as the
    relay's hint says; a fractional one would come back from NATS a nanosecond short."""
    return math.ceil(window)


async def set_up_stream(destination: Destination, window: float, dry_run: bool) -> Change:
    """Create or update the JetStream stream of a NATS destination (see the module doc)."""
    nats: Any = optional_client("nats", "a destination of kind nats", "nats", "nats.js")
    options = destination.options
    assert isinstance(options, NatsOptions), "set up for NATS destinations only"
    name = options.stream
    wanted = stream_subject(options.subject)
    thing = f"NATS stream {name}"
    client = await _connect_nats(nats, destination)
    try:
        js = client.jetstream(timeout=destination.timeout)
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            if not dry_run:
                await js.add_stream(
                    name=name,
                    subjects=[wanted],
                    duplicate_window=whole_seconds(window),
                    storage=nats.js.api.StorageType.FILE,
                )
            shown = f"subjects {wanted}, duplicate window {whole_seconds(window)}s"
            return Change(thing, "created", shown)
        config = info.config
        changes, said = stream_changes(config, wanted, window, destination.allow_short_retention)
        if not changes:
            shown = ", ".join(config.subjects or ())
            kept = f"subjects {shown}, duplicate window {float(config.duplicate_window or 0):g}s"
            return Change(thing, "unchanged", "; ".join([kept, *said]))
        if not dry_run:
            await update_stream_as_served(client, name, changes, destination.timeout)
        return Change(thing, "updated", "; ".join(said))
    except nats.js.errors.APIError as exc:
        refusal = f"NATS refused to set up stream {name!r}: {exc.description}"
        if exc.err_code == _SUBJECTS_OVERLAP:
            refusal += await _owner_of(js, wanted, name)
        raise SetupRefused(refusal) from None
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise TransportError(f"{thing} not set up: {_describe(exc)}") from None
    finally:
        with contextlib.suppress(Exception):  # closing what failed: its error is the one to say
            await client.close()


async def update_stream_as_served(
    client: Any, name: str, changes: dict[str, Any], timeout: float
) -> None:
    """Update a stream's `changes` (subjects, duplicate_window in seconds) and nothing else.

    A JetStream update replaces the whole configuration, and nats-py's model of it holds
    only the fields that nats-py knows: sent back through it, a field of a newer server
    would be reset to its default. So the configuration goes back as the server served
    it, as JSON, with only the changed fields set. APIError when JetStream refuses.
    """
    served = await _jetstream_request(client, f"$JS.API.STREAM.INFO.{name}", b"", timeout)
    config = dict(served["config"])
    if "subjects" in changes:
        config["subjects"] = list(changes["subjects"])
    if "duplicate_window" in changes:
        config["duplicate_window"] = int(changes["duplicate_window"] * 1_000_000_000)  # ns
    update = json.dumps(config).encode()
    await _jetstream_request(client, f"$JS.API.STREAM.UPDATE.{name}", update, timeout)


async def _jetstream_request(client: Any, subject: str, data: bytes, timeout: float) -> Any:
    """One JetStream API request's JSON answer; nats-py's APIError when it holds an error."""
    nats: Any = optional_client("nats", "a destination of kind nats", "nats", "nats.js")
    answer = json.loads((await client.request(subject, data, timeout=timeout)).data)
    error = answer.get("error")
    if error:
        raise nats.js.errors.APIError(
            code=error.get("code"),
            description=error.get("description"),
            err_code=error.get("err_code"),
        )
    return answer


async def _owner_of(js: Any, subject: str, name: str) -> str:
    """`; stream X captures ...` naming another stream that holds the subject, or ""."""
    try:
        other = await js.find_stream_name_by_subject(subject)
    except Exception:  # noqa: BLE001 - only a hint: the refusal is said without it
        return ""
    if other == name:
        return ""
    return (
        f"; stream {other!r} captures subjects of {subject}: give the destination that "
        "stream, or a subject no other stream captures"
    )


async def _connect_nats(nats: Any, destination: Destination) -> Client:
    """A connection of its own that never reconnects: one failure is the answer."""

    async def quiet(exc: Exception) -> None:
        """The failure is reported once, by the exception connect raises."""

    try:
        client: Client = await nats.connect(
            destination.url,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0,
            connect_timeout=destination.timeout,
            error_cb=quiet,
            name="outbox-broker-setup",
        )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise TransportError(
            f"cannot connect to NATS at {redact_urls(destination.url)}: {_describe(exc)}"
        ) from None
    return client


@dataclass(frozen=True)
class QueueBinding:
    """A queue to declare and bind to each RabbitMQ destination's exchange."""

    queue: str
    binding: str | None = None
    """The binding key; None derives it from the routing key template (binding_key)."""


def exchange_binding(destination: Destination, exchange_type: str, given: str | None) -> str:
    """The binding key for a queue on this destination's exchange; ConfigError when none fits."""
    options = destination.options
    assert isinstance(options, RabbitMqOptions), "bindings for RabbitMQ destinations only"
    template = options.routing_key
    if given is not None:
        return given
    if exchange_type == "direct" and _with_wildcards(template, "#") != template:
        # A direct exchange matches keys exactly: `#` would be a literal key there (fanout
        # and headers exchanges ignore the key).
        raise ConfigError(
            f"routing_key {template!r} names {{ordering_key}} and a {exchange_type} exchange "
            "matches no wildcard: give --binding"
        )
    return binding_key(template)


async def set_up_exchange(
    destination: Destination,
    exchange_type: str,
    queue: QueueBinding | None,
    dry_run: bool,
) -> list[Change]:
    """Declare the exchange of a RabbitMQ destination and, when asked, a queue bound to it."""
    aio_pika: Any = optional_client("rabbitmq", "a destination of kind rabbitmq", "aio_pika")
    options = destination.options
    assert isinstance(options, RabbitMqOptions), "set up for RabbitMQ destinations only"
    name, template = options.exchange, options.routing_key
    if not name:
        return _default_exchange(template, queue)
    key = None if queue is None else exchange_binding(destination, exchange_type, queue.binding)
    try:
        connection = await aio_pika.connect(destination.url, timeout=destination.timeout)
    except Exception as exc:  # noqa: BLE001 - the client raises many kinds; all mean unreachable
        raise TransportError(
            f"cannot connect to RabbitMQ at {redact_urls(destination.url)}: {_describe(exc)}"
        ) from None
    broker = _Broker(aio_pika, connection)
    try:
        # A broker that stops answering mid-way must not hang a deploy step.
        async with connection, asyncio.timeout(destination.timeout):
            changes = [await broker.exchange(name, exchange_type, dry_run)]
            if queue is not None and key is not None:
                changes.append(await broker.queue(queue.queue, dry_run))
                new = any(change.action == "created" for change in changes)
                changes.append(await broker.bind(queue.queue, name, key, new, dry_run))
            return changes
    except (SetupRefused, TransportError):
        raise
    except TimeoutError:
        raise TransportError(
            f"RabbitMQ exchange {name!r} not set up: no answer within {destination.timeout:g}s"
        ) from None
    except (OSError, aio_pika.exceptions.AMQPConnectionError) as exc:
        raise TransportError(f"RabbitMQ exchange {name!r} not set up: {_describe(exc)}") from None
    except aio_pika.exceptions.AMQPError as exc:
        raise SetupRefused(f"RabbitMQ refused to set up exchange {name!r}: {exc}") from None


def _default_exchange(template: str, queue: QueueBinding | None) -> list[Change]:
    """The default exchange is built in and routes by queue name: nothing to declare."""
    thing = "RabbitMQ default exchange"
    if _with_wildcards(template, "#") != template:
        raise ConfigError(
            f"routing_key {template!r} names {{ordering_key}}, but the default exchange "
            "delivers only to the queue named by the routing key: use a named exchange"
        )
    if queue is not None:
        raise ConfigError(
            f"the default exchange takes no bindings: it delivers to the queue named "
            f"{template!r}; declare that queue with your consumer, or use a named exchange"
        )
    return [Change(thing, "nothing to set up", f"it delivers to the queue named {template!r}")]


class _Broker:
    """Declarations on one connection; each on a channel of its own, since a failed
    passive declare closes the channel it was made on."""

    def __init__(self, aio_pika: Any, connection: AbstractConnection) -> None:
        self.pika = aio_pika
        self.connection = connection

    async def _on_channel(self, work: Callable[[AbstractChannel], Awaitable[object]]) -> None:
        channel = await self.connection.channel()
        try:
            await work(channel)
        finally:
            if not channel.is_closed:
                await channel.close()

    async def _exists(self, passive: Callable[[AbstractChannel], Awaitable[object]]) -> bool:
        try:
            await self._on_channel(passive)
        except self.pika.exceptions.ChannelNotFoundEntity:
            return False
        return True

    async def exchange(self, name: str, exchange_type: str, dry_run: bool) -> Change:
        """Declare a durable exchange, or check that the one there has the same settings."""
        thing = f"RabbitMQ exchange {name}"
        settings = f"{exchange_type}, durable"

        async def declare(channel: AbstractChannel) -> None:
            await channel.declare_exchange(name, exchange_type, durable=True)

        if not await self._exists(lambda channel: channel.get_exchange(name, ensure=True)):
            if not dry_run:
                await self._on_channel(declare)
            return Change(thing, "created", settings)
        if name.startswith("amq."):
            # The broker's own exchanges cannot be declared, only used.
            return Change(thing, "unchanged", "built in")
        try:
            # Declaring with the same settings changes nothing; with others it is refused.
            await self._on_channel(declare)
        except self.pika.exceptions.ChannelPreconditionFailed as exc:
            raise SetupRefused(
                f"{thing} exists with other settings than {settings} ({_describe(exc)}); "
                "give --exchange-type to match it (an exchange's type and durability "
                "change only by deleting it)"
            ) from None
        return Change(thing, "unchanged", settings)

    async def queue(self, name: str, dry_run: bool) -> Change:
        """Declare a durable queue unless one of that name exists, which is left as it is."""
        thing = f"RabbitMQ queue {name}"
        if await self._exists(lambda channel: channel.get_queue(name, ensure=True)):
            return Change(thing, "unchanged", "exists; left as it is")

        async def declare(channel: AbstractChannel) -> None:
            await channel.declare_queue(name, durable=True)

        if not dry_run:
            await self._on_channel(declare)
        return Change(thing, "created", "durable")

    async def bind(self, queue: str, exchange: str, key: str, new: bool, dry_run: bool) -> Change:
        """Bind the queue to the exchange on `key`; binding again changes nothing."""
        thing = f"RabbitMQ binding {exchange} -> {queue} on {key!r}"

        async def bind(channel: AbstractChannel) -> None:
            bound = await channel.get_queue(queue, ensure=False)
            await bound.bind(exchange, key)

        if not dry_run:
            await self._on_channel(bind)
        if new:
            return Change(thing, "created")
        # AMQP cannot list bindings: a bind that was already there is a no-op.
        return Change(thing, "ensured", "binding again changes nothing")


def _describe(exc: BaseException) -> str:
    """An error's class and text, with URL credentials and secrets hidden."""
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
