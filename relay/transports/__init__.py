"""The destination transports, one module per kind, and their registry.

relay.transports.base holds the interface every kind implements; relay.transports.http,
.nats and .rabbitmq are the kinds (the broker ones import their client only when a
destination of theirs is built). This registry is the only module that imports them all,
and only the relay's assembly (relay.config, relay.dispatch, relay.loop, and the command
line's checks) imports it: a new kind is one module (its Transport and its KindOptions)
and its line in KINDS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from outbox.errors import ConfigError
from relay.destination import Destination, KindOptions
from relay.transports import nats, rabbitmq
from relay.transports.base import Transport, clients
from relay.transports.http import HttpOptions, http_transport


class Kind(NamedTuple):
    """What delivers to one kind of destination."""

    transport: Callable[[Destination], Transport]
    """Builds the transport of one destination of this kind."""
    options: type[KindOptions]
    """Its options: the keys of its config tables besides the common ones, checked."""
    clients: tuple[str, ...] = ()
    """The broker client modules its transport imports; the extra named as the kind
    installs them (pyproject.toml)."""


KINDS: dict[str, Kind] = {
    "http": Kind(http_transport, HttpOptions),
    "nats": Kind(nats.NatsTransport, nats.NatsOptions, nats.CLIENT_MODULES),
    "rabbitmq": Kind(rabbitmq.RabbitMqTransport, rabbitmq.RabbitMqOptions, rabbitmq.CLIENT_MODULES),
}
"""Each destination kind (the `kind` key of its config table) and what delivers to it."""


def check_kinds(destinations: Mapping[str, Destination]) -> None:
    """ConfigError unless every destination's kind has a transport and its client installed.

    Checked with the rest of the configuration, before the database is opened: a
    missing client is a setup error, not one of delivery.
    """
    for name, destination in destinations.items():
        kind = KINDS.get(destination.kind)
        if kind is None:
            raise ConfigError(
                f"destination {name!r}: kind {destination.kind!r} is not one of {sorted(KINDS)}"
            )
        if kind.clients:
            clients(destination.kind, kind.clients)


def transport_for(destination: Destination) -> Transport:
    """The transport that delivers to `destination`, by its kind."""
    return KINDS[destination.kind].transport(destination)
