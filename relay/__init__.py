"""The relay sidecar: leases outbox messages and delivers them through their transports.

relay.loop runs the turns; relay.leases is the database work; relay.dispatch
fans a turn out to relay.transports (HTTP, NATS JetStream, RabbitMQ).
"""

from __future__ import annotations

from outbox.errors import ConfigError
from relay.config import Destination, make_destination
from relay.loop import Relay

__all__ = ["ConfigError", "Destination", "Relay", "make_destination"]
