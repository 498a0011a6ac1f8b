"""Relay configuration: destinations by name, validated once at start.

Destinations come only from configuration; a message names one, never a URL.
Secrets are read from files or the environment, never from flag values that
would show up in `ps`.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import string
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import quote, urlsplit

from outbox.errors import ConfigError
from outbox.messages import check_destination
from outbox.redaction import redact_urls, shown_value, url_credentials
from outbox.signing import SigningKey, parse_secret
from outbox.unknown_keys import refuse_unknown

Mode = Literal["single", "batch"]

URL_SCHEMES: dict[str, tuple[str, ...]] = {
    "http": ("http", "https"),
    "nats": ("nats", "tls"),
    "rabbitmq": ("amqp", "amqps"),
}
"""The URL schemes each kind of destination takes."""
KIND_KEYS: dict[str, tuple[str, ...]] = {
    "nats": ("stream", "subject"),
    "rabbitmq": ("exchange", "routing_key"),
}
"""The keys a kind of destination requires besides url; no other kind may set them."""
TEMPLATE_FIELDS = ("ordering_key",)
"""What a subject or routing key template may name, as {ordering_key}."""


@dataclass(frozen=True)
class Destination:
    """Where messages for one destination name go, and how."""

    url: str
    secret: str | None = field(default=None, repr=False)
    timeout: float = 10.0
    mode: Mode = "single"
    concurrency: int = 8
    receipt_lookup: bool = False
    batch_url: str | None = None
    max_batch_items: int = 500
    max_batch_bytes: int = 1_000_000
    ordered_batches: bool = False
    """HTTP batch mode: the receiver applies a batch's items of one ordering key in order
    and answers `held` after one it did not apply, so a batch may hold several of them."""
    require_retention: bool = False
    """Refuse to start when the destination publishes no receipt retention."""
    kind: str = "http"
    """Which transport delivers here (relay.transports.KINDS); `mode` chooses within HTTP."""
    unsigned: bool = False
    """Send without signatures: only when said, never because the secret was left out."""
    allow_short_retention: bool = False
    """Run even when the destination keeps receipts (or a broker its duplicate window)
    shorter than the retry window: a late resend could then apply twice (a warning)."""
    stream: str | None = None
    """NATS: the JetStream stream the subject belongs to (checked at start)."""
    subject: str | None = None
    """NATS: the subject to publish on; a template that may name {ordering_key}."""
    exchange: str | None = None
    """RabbitMQ: the exchange to publish to ("" is the default exchange)."""
    routing_key: str | None = None
    """RabbitMQ: the routing key; a template that may name {ordering_key}."""

    @functools.cached_property
    def credentials(self) -> tuple[str, ...]:
        """What this destination's stored and logged errors must never quote: its URLs'
        query strings and userinfo, and its secret (whole and without its prefix)."""
        found = url_credentials(self.url)
        if self.batch_url is not None:
            found += url_credentials(self.batch_url)
        if self.secret is not None:
            found += [self.secret, self.secret.removeprefix("whsec_")]
        return tuple(found)

    @functools.cached_property
    def signing_key(self) -> SigningKey | None:
        """The secret decoded once: a broker delivery signs every message on its own."""
        return None if self.secret is None else parse_secret(self.secret)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise ConfigError(f"destination kind must be a name, got {shown_value(self.kind)}")
        parts = urlsplit(self.url)
        schemes = URL_SCHEMES.get(self.kind)
        if schemes is not None and (parts.scheme not in schemes or not parts.netloc):
            shown = "|".join(schemes)
            raise ConfigError(
                f"destination url of kind {self.kind} must be {shown}://host..., "
                f"got {redact_urls(self.url)!r}"
            )
        self._check_kind_keys()
        if not self.timeout > 0:
            raise ConfigError(f"destination timeout must be > 0, got {self.timeout!r}")
        if self.mode not in ("single", "batch"):
            raise ConfigError(
                f"destination mode must be 'single' or 'batch', got {shown_value(self.mode)}"
            )
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

    def _check_kind_keys(self) -> None:
        """Each kind's own keys given, no other kind's; HTTP's options only on HTTP."""
        for kind, keys in KIND_KEYS.items():
            for key in keys:
                value = getattr(self, key)
                if kind == self.kind and value is None:
                    raise ConfigError(f"a destination of kind {kind} needs {key}")
                if kind != self.kind and value is not None:
                    raise ConfigError(f"{key} is a key of {kind} destinations, not of {self.kind}")
                if key in ("subject", "routing_key") and value is not None:
                    check_template(key, value)
                if key == "stream" and value is not None:
                    check_stream_name(value)
        if self.kind != "http":
            for key, value, default in (
                ("mode", self.mode, "single"),
                ("batch_url", self.batch_url, None),
                ("receipt_lookup", self.receipt_lookup, False),
                ("ordered_batches", self.ordered_batches, False),
            ):
                if value != default:
                    raise ConfigError(f"{key} is a key of http destinations, not of {self.kind}")

    @property
    def post_batch_url(self) -> str:
        """The batch endpoint: configured, or `<url>/batch` for the reference receiver."""
        return self.batch_url or self.url.rstrip("/") + "/batch"

    def lookup_url(self, reply_id: str) -> str:
        """The receipt lookup for one message: GET `<url>/<reply_id>` (the id percent-encoded)."""
        return f"{self.url.rstrip('/')}/{quote(reply_id, safe='')}"


_STREAM_NAME_REFUSED = frozenset(" \t.*>/\\")


def check_stream_name(name: str) -> None:
    """ConfigError unless `name` is a JetStream stream name: printable, without whitespace,
    '.', '*', '>', '/' or '\\' (names NATS refuses, or whose PubAcks could not be read)."""
    if not name or any(c in _STREAM_NAME_REFUSED or not c.isprintable() for c in name):
        raise ConfigError(
            f"stream {name!r} is not a JetStream stream name: printable characters "
            "without whitespace, '.', '*', '>', '/' or '\\'"
        )


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
    if key == "subject" and any(c in template for c in " \t\r\n"):
        # The relay publishes without the client's per-message subject check.
        raise ConfigError(f"{key} {template!r} must not hold spaces, tabs or line breaks")


def check_destinations(destinations: Mapping[str, Destination]) -> dict[str, Destination]:
    """Validate names and types of the destination table."""
    if not destinations:
        raise ConfigError("at least one destination is required")
    checked: dict[str, Destination] = {}
    for name, destination in destinations.items():
        try:
            check_destination(name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if not isinstance(destination, Destination):
            raise ConfigError(f"destination {name!r} must be a Destination")
        checked[name] = destination
    return checked


def read_secret(path: str | Path) -> str:
    """The first non-empty line of a secret file."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            return line.strip()
    raise ConfigError(f"secret file {path} is empty")


def load_destinations(
    path: str | Path | None, environ: Mapping[str, str] = os.environ
) -> dict[str, Destination]:
    """The destinations of a TOML config file (if any) and of OUTBOX_DESTINATION_* variables."""
    document: dict[str, Any] = {}
    if path is not None:
        try:
            document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read relay config {path}: {exc}") from exc
    return destinations_from(document, path, environ)


def _text(value: object) -> str:
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


def _number(value: object) -> float:
    return _numeric(value, float, int | float, "a number")


def _count(value: object) -> int:
    return _numeric(value, int, int, "a whole number")


def _flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"expected true or false, got {shown_value(value)}")


# Each key of a [destinations.NAME] table (or OUTBOX_DESTINATION_NAME_KEY variable) and
# how its value is read: TOML gives typed values, the environment gives text.
DESTINATION_KEYS: dict[str, Callable[[object], Any]] = {
    "kind": _text,
    "url": _text,
    "secret": _text,
    "secret_file": _text,
    "secret_env": _text,
    "timeout": _number,
    "mode": _text,
    "concurrency": _count,
    "receipt_lookup": _flag,
    "batch_url": _text,
    "max_batch_items": _count,
    "max_batch_bytes": _count,
    "ordered_batches": _flag,
    "require_retention": _flag,
    "unsigned": _flag,
    "allow_short_retention": _flag,
    "stream": _text,
    "subject": _text,
    "exchange": _text,
    "routing_key": _text,
}
SECRET_KEYS = ("secret", "secret_file", "secret_env")
DESTINATION_ENV_PREFIX = "OUTBOX_DESTINATION_"
# Longest first, so that OUTBOX_DESTINATION_BILLING_BATCH_URL is billing's batch_url.
_ENV_KEYS = sorted(DESTINATION_KEYS, key=len, reverse=True)


def destination_variable(name: str) -> tuple[str, str] | None:
    """(destination, key) named by an OUTBOX_DESTINATION_NAME_KEY variable, or None."""
    readings = _readings(name)
    return readings[0] if readings else None


def _readings(name: str) -> list[tuple[str, str]]:
    """Every (destination, key) a variable name can be read as, longest key first."""
    if not name.startswith(DESTINATION_ENV_PREFIX):
        return []
    rest = name[len(DESTINATION_ENV_PREFIX) :]
    return [
        (rest[: -len(key) - 1].lower(), key)
        for key in _ENV_KEYS
        if rest.endswith("_" + key.upper()) and len(rest) > len(key) + 1
    ]


def _check_unambiguous(environ: Mapping[str, str], file_names: Iterable[str]) -> None:
    """Refuse a variable that could set another destination than the one it is read for."""
    known = {name.lower(): name for name in file_names}
    for variable in environ:
        readings = _readings(variable)
        if not readings:
            continue
        name, key = readings[0]
        if name in known and known[name] != name:
            raise ConfigError(
                f"{variable} names destination {name!r}, but the file has {known[name]!r}: "
                "names from the environment are lowercase; rename the table"
            )
        for other, other_key in readings[1:]:
            if other in known:
                raise ConfigError(
                    f"{variable} could set {key} of {name!r} or {other_key} of {other!r}; "
                    "rename one of the destinations"
                )


def environment_tables(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The destination tables that OUTBOX_DESTINATION_NAME_KEY variables define."""
    tables: dict[str, dict[str, str]] = {}
    for variable in sorted(environ):
        if not variable.startswith(DESTINATION_ENV_PREFIX):
            continue
        named = destination_variable(variable)
        if named is None:
            keys = ", ".join(key.upper() for key in DESTINATION_KEYS)
            raise ConfigError(
                f"{variable}: expected {DESTINATION_ENV_PREFIX}<NAME>_<KEY> with KEY one of {keys}"
            )
        if not environ[variable]:
            raise ConfigError(f"{variable} is set but empty")
        name, key = named
        tables.setdefault(name, {})[key] = environ[variable]
    return tables


def referenced_variables(document: Mapping[str, Any]) -> set[str]:
    """The environment variables a config file names as secret sources (`secret_env`)."""
    tables = document.get("destinations")
    if not isinstance(tables, dict):
        return set()
    return {
        table["secret_env"]
        for table in tables.values()
        if isinstance(table, dict) and isinstance(table.get("secret_env"), str)
    }


def destinations_from(
    document: Mapping[str, Any],
    path: str | Path | None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, Destination]:
    """The destinations of a parsed config file (`path` names it in errors) and of the
    OUTBOX_DESTINATION_* variables, which take precedence key by key."""
    tables = document.get("destinations", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: destinations must be tables [destinations.NAME]")
    merged: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: destinations.{name} must be a table")
        if "secret" in table:
            raise ConfigError(
                f"{path}: destinations.{name}: a secret is not written in the file; "
                "use secret_file or secret_env"
            )
        merged[name] = (f"{path}: destinations.{name}", dict(table))
    _check_unambiguous(environ, tables)
    for name, table in environment_tables(environ).items():
        where, values = merged.get(name, ("", {}))
        if any(key in table for key in SECRET_KEYS):
            for key in SECRET_KEYS:  # the environment's secret replaces the file's
                values.pop(key, None)
        where = f"{where} and " if where else ""
        merged[name] = (f"{where}{DESTINATION_ENV_PREFIX}{name.upper()}_*", {**values, **table})
    if not merged:
        raise ConfigError(
            "at least one destination is required: a [destinations.NAME] table in the config "
            f"file, or {DESTINATION_ENV_PREFIX}<NAME>_URL and its other variables"
        )
    return check_destinations(
        {name: _destination(where, table, environ) for name, (where, table) in merged.items()}
    )


def _destination(where: str, table: Mapping[str, Any], environ: Mapping[str, str]) -> Destination:
    """One destination from its merged table; ConfigError names `where` it came from."""
    refuse_unknown(where, table, DESTINATION_KEYS)
    if "url" not in table:
        raise ConfigError(f"{where}: url is required")
    given = [key for key in SECRET_KEYS if key in table]
    if len(given) > 1:
        raise ConfigError(f"{where}: give one of {', '.join(given)}, not several")
    values: dict[str, Any] = {}
    for key, value in table.items():
        try:
            values[key] = DESTINATION_KEYS[key](value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from exc
    if "secret_file" in values:
        values["secret"] = read_secret(values.pop("secret_file"))
    elif "secret_env" in values:
        variable = values.pop("secret_env")
        values["secret"] = environ.get(variable)
        if not values["secret"]:
            raise ConfigError(f"{where}: secret_env: ${variable} is not set")
    try:
        return Destination(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def check_relay_settings(
    destinations: Mapping[str, Destination],
    *,
    owner: str | None,
    lease: float,
    counts: Mapping[str, int],
    backoff: float,
    backoff_cap: float,
    poll_interval: float,
) -> str:
    """Validate a relay's settings (ConfigError names the bad one); returns its owner name."""
    longest = max(d.timeout for d in destinations.values())
    if not lease > longest:
        raise ConfigError(
            f"lease ({lease:g}s) must be longer than the longest attempt timeout "
            f"({longest:g}s), or a slow attempt would outlive its lease"
        )
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if not (backoff > 0 and backoff_cap >= backoff and poll_interval > 0):
        raise ConfigError("backoff, backoff_cap and poll_interval must be positive")
    if owner is None:
        # Unique per instance: relays sharing an owner name could not tell their leases
        # apart.
        owner = f"relay-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"[-200:]
    if not isinstance(owner, str) or not 1 <= len(owner) <= 200 or "\x00" in owner:
        raise ConfigError("owner must be a str of 1..200 characters without NUL")
    return owner
