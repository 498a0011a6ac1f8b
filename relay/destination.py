"""A destination: where the messages of one destination name go, and how.

Destination holds what every kind of destination has (its url, secret, timeout,
concurrency, parcel limits and the receipt retention checks); what only one kind
has is its `options`, a frozen dataclass of that kind's transport module
(relay.transports.http.HttpOptions, .nats.NatsOptions, .rabbitmq.RabbitMqOptions)
that checks its own values. relay.config reads both from a [destinations.NAME]
table, through the registry of kinds (relay.transports).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar
from urllib.parse import quote, urlsplit

from outbox.errors import ConfigError
from outbox.redaction import redact_urls, shown_value, url_credentials
from outbox.signing import SigningKey, parse_secret

Reader = Callable[[object], Any]
"""How a key's value is read: TOML gives typed values, the environment gives text;
ValueError when it is neither."""


def text(value: object) -> str:
    """A text value."""
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {shown_value(value)}")
    return value


N = TypeVar("N", int, float)


def _numeric(value: object, read: Callable[[Any], N], kinds: Any, wanted: str) -> N:
    """`read(value)` for text (the environment's) or a value of `kinds` (TOML's); else a
    ValueError that shows the value as shown_value() allows."""
    try:
        if isinstance(value, str) or (not isinstance(value, bool) and isinstance(value, kinds)):
            return read(value)
    except ValueError:
        pass  # int()'s and float()'s own messages quote the whole value
    raise ValueError(f"expected {wanted}, got {shown_value(value)}")


def number(value: object) -> float:
    """A number, whole or not."""
    return _numeric(value, float, int | float, "a number")


def count(value: object) -> int:
    """A whole number."""
    return _numeric(value, int, int, "a whole number")


def flag(value: object) -> bool:
    """True or false (the environment's true, 1, yes, false, 0, no)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"expected true or false, got {shown_value(value)}")


COMMON_KEYS: Mapping[str, Reader] = {
    "kind": text,
    "url": text,
    "secret": text,
    "secret_file": text,
    "secret_env": text,
    "timeout": number,
    "concurrency": count,
    "max_batch_items": count,
    "max_batch_bytes": count,
    "require_retention": flag,
    "unsigned": flag,
    "allow_short_retention": flag,
}
"""The keys of every kind's [destinations.NAME] table, and how each value is read."""


@dataclass(frozen=True)
class KindOptions:
    """The options only one kind of destination has.

    A kind's options class is a frozen dataclass whose fields are the keys of its
    config tables (one without a default is required) and whose __post_init__ checks
    their values, raising ConfigError.
    """

    KIND: ClassVar[str] = ""
    """The `kind` of the config tables these options belong to."""
    URL_SCHEMES: ClassVar[tuple[str, ...]] = ()
    """The URL schemes a destination of this kind takes; empty: any."""
    KEYS: ClassVar[Mapping[str, Reader]] = {}
    """Each field as a key of the config table, and how its value is read."""

    def other_urls(self) -> tuple[str, ...]:
        """URLs besides the destination's own whose credentials errors must never quote."""
        return ()

    def asks_receipts(self) -> bool:
        """Whether the relay may ask the destination for a message's receipt."""
        return False


def check_url(url: str, options_class: type[KindOptions]) -> None:
    """Refuse a URL whose scheme the kind does not take (ConfigError)."""
    schemes = options_class.URL_SCHEMES
    parts = urlsplit(url)
    if schemes and (parts.scheme not in schemes or not parts.netloc):
        shown = "|".join(schemes)
        raise ConfigError(
            f"destination url of kind {options_class.KIND} must be {shown}://host..., "
            f"got {redact_urls(url)!r}"
        )
    if parts.scheme in ("http", "https"):
        # A port outside 0-65535 would fail every request (broker URLs are their clients').
        try:
            parts.port  # noqa: B018 - reading it is the check
        except ValueError as exc:
            raise ConfigError(f"destination url {redact_urls(url)!r}: {exc}") from None


@dataclass(frozen=True)
class Destination:
    """Where messages for one destination name go, and how."""

    url: str
    options: KindOptions
    """What only this destination's kind has (its transport module's options class)."""
    secret: str | None = field(default=None, repr=False)
    timeout: float = 10.0
    concurrency: int = 8
    max_batch_items: int = 500
    """Messages per HTTP batch or broker parcel."""
    max_batch_bytes: int = 1_000_000
    require_retention: bool = False
    """Refuse to start when the destination publishes no receipt retention."""
    unsigned: bool = False
    """Send without signatures: only when said, never because the secret was left out."""
    allow_short_retention: bool = False
    """Run even when the destination keeps receipts (or a broker its duplicate window)
    shorter than the retry window: a late resend could then apply twice (a warning)."""

    @property
    def kind(self) -> str:
        """Which transport delivers here (relay.transports.KINDS): its options' kind."""
        return self.options.KIND

    @property
    def receipt_lookup(self) -> bool:
        """Whether a message's receipt may be asked of the destination (HTTP's option)."""
        return self.options.asks_receipts()

    @functools.cached_property
    def credentials(self) -> tuple[str, ...]:
        """What this destination's stored and logged errors must never quote: its URLs'
        query strings and userinfo, and its secret (whole and without its prefix)."""
        found = url_credentials(self.url)
        for url in self.options.other_urls():
            found += url_credentials(url)
        if self.secret is not None:
            found += [self.secret, self.secret.removeprefix("whsec_")]
        return tuple(found)

    @functools.cached_property
    def signing_key(self) -> SigningKey | None:
        """The secret decoded once: a broker delivery signs every message on its own."""
        return None if self.secret is None else parse_secret(self.secret)

    def __post_init__(self) -> None:
        if not isinstance(self.options, KindOptions):
            raise ConfigError(f"destination options must be KindOptions, got {self.options!r}")
        check_url(self.url, type(self.options))
        if not self.timeout > 0:
            raise ConfigError(f"destination timeout must be > 0, got {self.timeout!r}")
        if self.concurrency < 1:
            raise ConfigError(f"destination concurrency must be >= 1, got {self.concurrency!r}")
        if self.max_batch_items < 1 or self.max_batch_bytes < 1024:
            raise ConfigError("max_batch_items must be >= 1 and max_batch_bytes >= 1024")
        if self.secret is None and not self.unsigned:
            raise ConfigError(
                "destination has no secret: give secret_file or secret_env (or "
                "OUTBOX_DESTINATION_<NAME>_SECRET), or unsigned = true to send unsigned"
            )
        if self.secret is not None and self.unsigned:
            raise ConfigError("destination has a secret and unsigned = true: choose one")
        if self.secret is not None:
            try:
                parse_secret(self.secret)
            except (TypeError, ValueError) as exc:
                # The message never holds the value: it may be almost the real secret.
                raise ConfigError(f"destination secret: {exc}") from None

    def lookup_url(self, reply_id: str) -> str:
        """The receipt lookup for one message: GET `<url>/<reply_id>` (the id percent-encoded)."""
        return f"{self.url.rstrip('/')}/{quote(reply_id, safe='')}"
