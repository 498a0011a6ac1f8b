"""The relay sidecar: leases outbox messages and delivers them over signed HTTP."""

from __future__ import annotations

from relay.config import ConfigError, Destination
from relay.runner import Relay

__all__ = ["ConfigError", "Destination", "Relay"]
