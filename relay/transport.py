"""The destination transport interface: how messages reach one kind of destination.

A transport groups a destination's messages into parcels (one request each),
sends a parcel and classifies the answer into one outcome per message, asks
for a receipt, and checks how long the destination keeps receipts. A new kind
of destination is one module implementing Transport, its entry in TRANSPORTS
and the `kind` its config tables name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from urllib.parse import urlsplit, urlunsplit

from outbox.clients import optional_client
from outbox.errors import ConfigError, TransportError
from outbox.redaction import redact_urls
from relay.config import Destination
from relay.http_client import HttpClient
from relay.policy import Outcome
from relay.receipts import receipt_matches
from relay.records import Message


@dataclass(frozen=True)
class Parcel:
    """Messages that travel in one request, with the request body when it is prepared."""

    messages: Sequence[Message]
    body: bytes | None = None


class Transport(ABC):
    """Delivery to one destination; its requests run on the relay's event loop."""

    def __init__(self, destination: Destination) -> None:
        """Nothing connects until the first request."""
        self.destination = destination

    @property
    def mode(self) -> str:
        """The label of this transport in metrics."""
        return self.destination.mode

    @abstractmethod
    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """Group messages into requests, within the destination's limits.

        Messages of one ordering key come in id order and stay in that order across
        the parcels; the dispatcher sends a parcel only after the earlier ones that hold
        one of its keys. A parcel holding several messages of a key is sent by a
        transport that keeps them in order: it applies or publishes one only after the
        earlier ones of its key, and holds back (HELD) the key's later ones once one
        ends neither sent nor dead.
        """

    @abstractmethod
    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """Deliver one parcel: an outcome for each of its messages, by message id."""

    @abstractmethod
    async def holds(self, message: Message) -> bool | None:
        """Whether the destination holds this exact message; None when it cannot say."""

    @abstractmethod
    async def retention(self) -> float | None:
        """How long the destination keeps receipts (seconds), when it says."""

    def check_retention_later(self, required: float) -> None:  # noqa: B027 - optional hook
        """The start check could not ask: check for `required` seconds before delivering.

        Only a transport that can ask on its own connection does (NATS: the stream's
        duplicate window); the others keep the start check's warning alone.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""


class HttpTransport(Transport):
    """The common part of HTTP transports: one pooled client, receipt lookup, retention."""

    RETENTION_HEADER = "outbox-receipt-retention"

    def __init__(self, destination: Destination) -> None:
        """One keep-alive client per destination, at most `concurrency` connections."""
        super().__init__(destination)
        self.client = HttpClient(destination.concurrency)

    async def holds(self, message: Message) -> bool | None:
        """GET <url>/<reply_id> and compare the content hash."""
        return await receipt_matches(
            self.client, self.destination, message.reply_id, message.content_hash
        )

    async def retention(self) -> float | None:
        """The Outbox-Receipt-Retention header of the destination's /healthz, if any.

        Unreachable now is a delivery problem, retried like any other: the caller
        is told by TimeoutError or TransportError that it could not be checked.
        """
        health = health_url(self.destination.url)
        response = await self.client.request(
            "GET", health, headers={}, seconds=self.destination.timeout
        )
        if not 200 <= response.status < 300:
            raise TransportError(f"{redact_urls(health)} answered {response.status}")
        advertised = response.headers.get(self.RETENTION_HEADER)
        try:
            retention = float(advertised) if advertised is not None else math.nan
        except ValueError:
            retention = math.nan
        # Absent or unreadable (not a number, NaN, negative): published as none.
        return retention if math.isfinite(retention) and retention >= 0 else None

    async def close(self) -> None:
        """Close the pooled connections."""
        await self.client.close()


def health_url(url: str) -> str:
    """The /healthz next to a destination url: a sibling of its last path segment."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/").rsplit("/", 1)[0] if "/" in parts.path.strip("/") else ""
    return urlunsplit((parts.scheme, parts.netloc, path + "/healthz", "", ""))


def _http(destination: Destination) -> Transport:
    # Imported here: each implementation builds on this module.
    from relay.http_batch import HttpBatchTransport
    from relay.http_single import HttpSingleTransport

    if destination.mode == "batch":
        return HttpBatchTransport(destination)
    return HttpSingleTransport(destination)


def _nats(destination: Destination) -> Transport:
    # Imported here: it needs the optional NATS client, which HTTP-only relays lack.
    from relay.nats_transport import NatsTransport

    return NatsTransport(destination)


def _rabbitmq(destination: Destination) -> Transport:
    # Imported here: it needs the optional AMQP client, which HTTP-only relays lack.
    from relay.rabbitmq_transport import RabbitMqTransport

    return RabbitMqTransport(destination)


TRANSPORTS: dict[str, Callable[[Destination], Transport]] = {
    "http": _http,
    "nats": _nats,
    "rabbitmq": _rabbitmq,
}
"""Each destination kind (the `kind` key of its config table) and what builds its transport."""


CLIENT_MODULES: dict[str, tuple[str, ...]] = {
    "nats": ("nats",),
    "rabbitmq": ("aio_pika", "aiormq"),
}
"""The broker client modules each kind's transport uses; the extra named as the kind
installs them (pyproject.toml)."""


def clients(kind: str) -> list[ModuleType]:
    """The client modules of `kind`, in CLIENT_MODULES order; ConfigError naming the extra
    to install when one is missing."""
    needed_for = f"a destination of kind {kind}"
    return [optional_client(kind, needed_for, module) for module in CLIENT_MODULES[kind]]


def check_kinds(destinations: Mapping[str, Destination]) -> None:
    """ConfigError unless every destination's kind has a transport and its client installed.

    Checked with the rest of the configuration, before the database is opened: a
    missing client is a setup error, not one of delivery.
    """
    for name, destination in destinations.items():
        if destination.kind not in TRANSPORTS:
            raise ConfigError(
                f"destination {name!r}: kind {destination.kind!r} is not one of "
                f"{sorted(TRANSPORTS)}"
            )
        if destination.kind in CLIENT_MODULES:
            clients(destination.kind)


def transport_for(destination: Destination) -> Transport:
    """The transport that delivers to `destination`, by its kind (and, for HTTP, its mode)."""
    return TRANSPORTS[destination.kind](destination)
