"""RabbitMQ: each message published to an exchange, persistent, mandatory, with confirms.

A message is published with its stored body bytes unchanged, `message_id` = its
reply_id, content type application/json, delivery mode persistent, and as AMQP
headers the broker headers every broker transport sends (relay.transports.broker_headers:
signature, content hash, traceparent). The routing key is the destination's
template with {ordering_key} filled in.

A parcel's messages are published at once, except that a key's later messages are each
published only once the one before is confirmed: a nacked message's retry can never be
queued behind its key's next, and the key's messages after one that ends neither sent nor
dead are held back for a later turn.

The broker's publisher confirm is the ACK: an ack is sent; a nack, a missing
confirm within the timeout, or a lost connection or channel is retried (the
message may already be queued: RabbitMQ does not dedupe, so a resend can queue
it twice). A message the exchange cannot route to any queue comes back
(mandatory) and goes dead with that reason instead of vanishing; so does one
published to an exchange that does not exist. The relay refuses to start when
the exchange does not exist.

RabbitMQ keeps no duplicate window and cannot be asked whether it holds a
message: `retention()` and `holds()` say None. The guarantee is at-least-once
into the queue; effects happen once only through a consumer that dedupes by
(reply_id, content hash), as the receiver's consume loop does.

The connection is opened on first use. After a lost connection (or a missing
confirm, which may mean a half-open one) the next send opens a new one at once:
a background reconnect would only make that send wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

from outbox.errors import ConfigError
from outbox.redaction import redact, redact_urls
from relay.destination import Destination, KindOptions, Reader, text
from relay.errors import TransportError
from relay.policy import ACKED, HELD, Dead, Outcome, Retry, Sent, truncate
from relay.records import Message, key_chains
from relay.transports.base import Parcel, Transport, check_template, clients
from relay.transports.broker_headers import broker_headers

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection
    from aiormq.channel import Channel

CLIENT_MODULES = ("aio_pika", "aiormq")
"""The client the rabbitmq extra installs (pyproject.toml): aio-pika, and aiormq under it."""
MAX_ROUTING_KEY_BYTES = 255
"""AMQP 0-9-1 carries a routing key as a short string."""
NACKED = "the broker nacked the message"
PERSISTENT = 2
"""AMQP delivery mode 2: the broker writes the message to disk in a durable queue."""
NO_ORDERING_KEY = "_"
"""What {ordering_key} becomes for a message without one: a word of its own, so that
`orders.{ordering_key}` still matches a binding on `orders.*`."""


@dataclass(frozen=True)
class RabbitMqOptions(KindOptions):
    """What a RabbitMQ destination has besides the common keys (docs/reference/config.md)."""

    KIND: ClassVar[str] = "rabbitmq"
    URL_SCHEMES: ClassVar[tuple[str, ...]] = ("amqp", "amqps")
    KEYS: ClassVar[Mapping[str, Reader]] = {"exchange": text, "routing_key": text}

    exchange: str
    """The exchange to publish to ("" is the default exchange)."""
    routing_key: str
    """The routing key; a template that may name {ordering_key}."""

    def __post_init__(self) -> None:
        check_template("routing_key", self.routing_key)


class ExchangeMissing(Exception):
    """The destination's exchange does not exist on the broker."""


def routing_key(template: str, message: Message) -> str:
    """The routing key of `message`: the template with its {ordering_key} filled in."""
    key = message.ordering_key
    return template.format_map({"ordering_key": NO_ORDERING_KEY if key is None else key})


class RabbitMqTransport(Transport):
    """Publishes each parcel's messages concurrently on one confirming channel."""

    MESSAGING_SYSTEM = "rabbitmq"

    def __init__(self, destination: Destination) -> None:
        """Checks that the AMQP client is installed; nothing connects until the first send."""
        super().__init__(destination)
        # aiormq, aio-pika's own dependency: its channel publishes without aio-pika's
        # per-message wrapping, and without waiting for each frame to be flushed.
        aio_pika, aiormq = clients("rabbitmq", CLIENT_MODULES)
        self._properties = aiormq.spec.Basic.Properties
        options = destination.options
        if not isinstance(options, RabbitMqOptions):
            raise ConfigError(
                f"a destination of kind rabbitmq has RabbitMqOptions, not {options!r}"
            )
        self._pika = aio_pika
        self.exchange_name = options.exchange
        self.template = options.routing_key
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._publisher: Channel | None = None
        """The channel under `_channel`, which publishes."""
        self._opening = asyncio.Lock()

    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """Up to max_batch_items messages per parcel: their confirms are awaited together."""
        size = self.destination.max_batch_items
        return [Parcel(messages[i : i + size]) for i in range(0, len(messages), size)]

    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """Publish every message of the parcel at once; each settles by its own confirm."""
        messages = parcel.messages
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.destination.timeout
        try:
            async with asyncio.timeout_at(deadline):
                connection, channel = await self._open()
        except ExchangeMissing as exc:
            missing = Dead(None, str(exc), of_destination=True)
            return dict.fromkeys((m.id for m in messages), missing)
        except TimeoutError:
            seconds = self.destination.timeout
            failed = Retry(None, f"no connection to the broker within {seconds:g}s")
            return dict.fromkeys((m.id for m in messages), failed)
        except Exception as exc:  # noqa: BLE001 - whatever failed, nothing was published
            failed = Retry(None, _failure("cannot connect", exc))
            return dict.fromkeys((m.id for m in messages), failed)
        signed_at = time.time()  # one reading of the clock for the parcel's signatures
        confirmed: dict[int, Outcome] = {}
        published: set[int] = set()
        publishes = [
            asyncio.ensure_future(self._in_order(channel, chain, signed_at, confirmed, published))
            for chain in key_chains(messages)
        ]
        # One wait for the whole parcel, not a timer per message: past the deadline
        # what is still unconfirmed is a retry, and a key's message not yet published
        # is held back.
        await asyncio.wait(publishes, timeout=max(0.0, deadline - loop.time()))
        for publish in publishes:
            if not publish.done():
                publish.cancel()
        late = Retry(None, f"no publisher confirm within {self.destination.timeout:g}s")
        outcomes = {
            m.id: confirmed.get(m.id, late if m.id in published else HELD) for m in messages
        }
        if any(isinstance(o, Retry) and o.error != NACKED for o in outcomes.values()):
            await self._forget(connection)
        return outcomes

    async def _in_order(
        self,
        channel: Channel,
        chain: Sequence[Message],
        signed_at: float,
        confirmed: dict[int, Outcome],
        published: set[int],
    ) -> None:
        """Publish one message, or a key's messages one after another, each once the one
        before is confirmed: a nacked message's retry can never be queued behind its key's
        next. A message that ends neither sent nor dead stops the key (the rest are HELD);
        a dead one (returned, unroutable) does not."""
        for index, message in enumerate(chain):
            published.add(message.id)
            try:
                outcome = await self._publish(channel, message, signed_at)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - building it failed: its row is odd
                # Said here, not left in a task nobody reads as "no publisher confirm".
                outcome = Retry(None, _failure("could not publish it", exc))
            confirmed[message.id] = outcome
            if not isinstance(outcome, Sent | Dead):
                for rest in chain[index + 1 :]:
                    confirmed[rest.id] = HELD
                return

    async def _publish(self, channel: Channel, message: Message, signed_at: float) -> Outcome:
        """Publish one message and wait for its confirm (or return)."""
        pika = self._pika
        key = routing_key(self.template, message)
        if len(key.encode()) > MAX_ROUTING_KEY_BYTES:
            return Dead(
                None,
                truncate(
                    f"routing key is {len(key.encode())} bytes, more than AMQP's "
                    f"{MAX_ROUTING_KEY_BYTES}: {key}"
                ),
            )
        headers = broker_headers(self.destination, message, signed_at)
        properties = self._properties(
            message_id=message.reply_id,
            content_type=headers.pop("content-type"),
            delivery_mode=PERSISTENT,
            headers=headers,
        )
        try:
            # wait=False: the frame is queued for the connection's writer, not flushed
            # before the next publish may start; the confirm is what is awaited.
            await channel.basic_publish(
                message.body,
                exchange=self.exchange_name,
                routing_key=key,
                properties=properties,
                mandatory=True,
                wait=False,
            )
        except pika.exceptions.PublishError:
            # The broker returned it: no queue is bound for this key. Resending the same
            # message to the same topology would only come back again.
            return Dead(
                None,
                truncate(
                    f"unroutable: no queue bound for exchange {self.exchange_name!r} "
                    f"routing key {key!r}"
                ),
                of_destination=True,  # the broker's topology, not the message
            )
        except pika.exceptions.DeliveryError:
            return Retry(None, NACKED)
        except pika.exceptions.ChannelNotFoundEntity:
            return Dead(None, self._missing(), of_destination=True)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # The client cancels pending confirms when its connection closes under them.
            return Retry(None, "connection closed before the publisher confirm")
        except Exception as exc:  # noqa: BLE001 - a lost connection or channel, in any form
            return Retry(None, _failure("connection lost", exc))
        return ACKED

    async def _open(self) -> tuple[AbstractConnection, Channel]:
        """The open connection and its publishing channel, opened now if there is none (or
        it was lost)."""
        async with self._opening:
            connection, channel, publisher = self._connection, self._channel, self._publisher
            if connection is not None and channel is not None and publisher is not None:
                if not connection.is_closed and not channel.is_closed:
                    return connection, publisher
                await self._forget(connection)
            pika = self._pika
            connection = await pika.connect(self.destination.url, timeout=self.destination.timeout)
            try:
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                if self.exchange_name:
                    # Passive: fails with 404 (and closes the channel) when it does not exist.
                    await channel.get_exchange(self.exchange_name, ensure=True)
                # aiormq's own class, whose basic_publish takes `wait`.
                publisher = cast("Channel", await channel.get_underlay_channel())
            except pika.exceptions.ChannelNotFoundEntity:
                await connection.close()
                raise ExchangeMissing(self._missing()) from None
            except BaseException:
                await connection.close()
                raise
            self._connection, self._channel, self._publisher = connection, channel, publisher
            return connection, publisher

    def _missing(self) -> str:
        return (
            f"exchange {self.exchange_name!r} does not exist on "
            f"{redact_urls(self.destination.url)}: declare it and bind its queues "
            "(`outbox broker setup --queue Q` does both)"
        )

    async def _forget(self, connection: AbstractConnection) -> None:
        """Close `connection` and, if it is still the current one, open anew next time."""
        if self._connection is connection:
            self._connection = self._channel = self._publisher = None
        with contextlib.suppress(Exception):  # it is being dropped for being broken
            await connection.close()

    async def holds(self, message: Message) -> bool | None:
        """RabbitMQ cannot be asked whether a queue holds a message: None."""
        return None

    async def retention(self) -> float | None:
        """None: RabbitMQ keeps no duplicate window. Checks first that the exchange exists.

        A missing exchange is a ConfigError (the relay refuses to start); an
        unreachable broker is a TransportError, retried like any delivery problem.
        """
        try:
            async with asyncio.timeout(self.destination.timeout):
                await self._open()
        except ExchangeMissing as exc:
            raise ConfigError(str(exc)) from None
        except TimeoutError:
            raise
        except Exception as exc:
            raise TransportError(_failure("cannot connect", exc)) from exc
        return None

    async def close(self) -> None:
        """Close the connection, if one is open."""
        if self._connection is not None:
            await self._forget(self._connection)


def _failure(what: str, exc: BaseException) -> str:
    """A short, redacted reason for a failure: the client's errors may quote the URL."""
    return truncate(redact(f"{what}: {type(exc).__name__}: {exc}"))
