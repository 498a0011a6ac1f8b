"""nats-py, the JetStream consumer's optional client library, imported where used."""

from __future__ import annotations

from typing import Any

from outbox.clients import optional_client


def nats_package() -> Any:
    """The nats package, or a ConfigError saying how to install it."""
    return optional_client("nats", "consuming from NATS", "nats", "nats.js.errors")
