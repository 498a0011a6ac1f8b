"""RabbitMQ setup: the exchange a destination publishes to, and a queue bound to it
(relay.broker_setup).

The exchange is declared durable, or checked to have the asked settings; a queue of that
name is declared unless it exists, then bound on the key the routing key template needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from outbox.clients import optional_client
from outbox.errors import ConfigError
from outbox.redaction import redact_urls
from relay.broker_setup import Change, binding_key, describe, with_wildcards
from relay.destination import Destination
from relay.errors import SetupRefused, TransportError
from relay.transports.rabbitmq import RabbitMqOptions

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection

EXCHANGE_TYPES = ("topic", "direct", "fanout", "headers")
"""The exchange types setup declares; topic by default, the one a template's wildcard fits."""
DEFAULT_EXCHANGE_TYPE = "topic"


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
    if exchange_type == "direct" and with_wildcards(template, "#") != template:
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
            f"cannot connect to RabbitMQ at {redact_urls(destination.url)}: {describe(exc)}"
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
        raise TransportError(f"RabbitMQ exchange {name!r} not set up: {describe(exc)}") from None
    except aio_pika.exceptions.AMQPError as exc:
        raise SetupRefused(f"RabbitMQ refused to set up exchange {name!r}: {exc}") from None


def _default_exchange(template: str, queue: QueueBinding | None) -> list[Change]:
    """The default exchange is built in and routes by queue name: nothing to declare."""
    thing = "RabbitMQ default exchange"
    if with_wildcards(template, "#") != template:
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
                f"{thing} exists with other settings than {settings} ({describe(exc)}); "
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
