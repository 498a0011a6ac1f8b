"""The destination transport interface: how messages reach one kind of destination.

A transport groups a destination's messages into parcels (one request each),
sends a parcel and classifies the answer into one outcome per message, asks
for a receipt, and checks how long the destination keeps receipts. A new kind
of destination is one module of relay.transports implementing Transport, and its
line in the registry (relay/transports/__init__.py) under the `kind` its config
tables name.
"""

from __future__ import annotations

import math
import string
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

from outbox.clients import optional_client
from outbox.durations import duration_text
from outbox.errors import ConfigError
from relay.destination import Destination
from relay.policy import Outcome
from relay.records import Message


@dataclass(frozen=True)
class Parcel:
    """Messages that travel in one request, with the request body when it is prepared."""

    messages: Sequence[Message]
    body: bytes | None = None


class Transport(ABC):
    """Delivery to one destination; its requests run on the relay's event loop."""

    MESSAGING_SYSTEM: ClassVar[str]
    """The `messaging.system` of this transport's send spans (OpenTelemetry's name for a
    broker; docs/how-to/tracing.md for HTTP)."""

    def __init__(self, destination: Destination) -> None:
        """Nothing connects until the first request."""
        self.destination = destination

    @property
    def mode(self) -> str:
        """The label of this transport in metrics: its kind, unless the kind says more."""
        return self.destination.kind

    def span_attributes(self) -> dict[str, str | int]:
        """What this transport's send spans say beyond the messaging attributes."""
        return {}

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

    def too_short(self, name: str, kept: float, longest: float) -> str:
        """Why destination `name` is refused for keeping receipts `kept` seconds, shorter
        than the `longest` retry window, and the two fixes: keep longer (the value needed),
        or run regardless."""
        needed = duration_text(math.ceil(longest))
        return (
            f"destination {name!r} keeps receipts for {duration_text(kept)}, shorter than the "
            f"longest retry window ({duration_text(longest)}): a late resend could apply twice. "
            f"Raise the receiver's retention to at least {needed} (outbox receiver --retention "
            f"{needed}), or set allow_short_retention = true to run regardless"
        )

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""


def clients(kind: str, modules: Sequence[str]) -> list[ModuleType]:
    """The client `modules` of `kind`, in that order; ConfigError naming the extra to
    install (the one named as the kind, pyproject.toml) when one is missing."""
    needed_for = f"a destination of kind {kind}"
    return [optional_client(kind, needed_for, module) for module in modules]


TEMPLATE_FIELDS = ("ordering_key",)
"""What a subject or routing key template may name, as {ordering_key}."""


def check_template(key: str, template: str) -> None:
    """ConfigError unless `template` is text naming at most {ordering_key}."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field]
    except ValueError as exc:
        raise ConfigError(f"{key} {template!r}: {exc}") from None
    unknown = sorted(set(fields) - set(TEMPLATE_FIELDS))
    if unknown:
        raise ConfigError(f"{key} {template!r} names {unknown}; only {{ordering_key}} is known")
    if not template:
        raise ConfigError(f"{key} must not be empty")
