"""Relay configuration: destinations by name, validated once at start.

Destinations come only from configuration; a message names one, never a URL.
Secrets are read from files or the environment, never from flag values that
would show up in `ps`.
"""

from __future__ import annotations

import os
import secrets
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit

from outbox.errors import ConfigError
from outbox.messages import check_destination

Mode = Literal["single", "batch"]


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
    require_retention: bool = False
    """Refuse to start when the destination publishes no receipt retention."""
    kind: str = "http"
    """Which transport delivers here (relay.transport.TRANSPORTS); `mode` chooses within HTTP."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise ConfigError(f"destination kind must be a name, got {self.kind!r}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"destination url must be http(s)://host/path, got {self.url!r}")
        if not self.timeout > 0:
            raise ConfigError(f"destination timeout must be > 0, got {self.timeout!r}")
        if self.mode not in ("single", "batch"):
            raise ConfigError(f"destination mode must be 'single' or 'batch', got {self.mode!r}")
        if self.concurrency < 1:
            raise ConfigError(f"destination concurrency must be >= 1, got {self.concurrency!r}")
        if self.max_batch_items < 1 or self.max_batch_bytes < 1024:
            raise ConfigError("max_batch_items must be >= 1 and max_batch_bytes >= 1024")
        if self.secret is not None and not self.secret.strip():
            raise ConfigError("destination secret is empty")

    @property
    def post_batch_url(self) -> str:
        """The batch endpoint: configured, or `<url>/batch` for the reference receiver."""
        return self.batch_url or self.url.rstrip("/") + "/batch"

    def lookup_url(self, reply_id: str) -> str:
        """The receipt lookup for one message: GET `<url>/<reply_id>` (the id percent-encoded)."""
        return f"{self.url.rstrip('/')}/{quote(reply_id, safe='')}"


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


def load_destinations(path: str | Path) -> dict[str, Destination]:
    """The `[destinations.NAME]` tables of a TOML config file."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read relay config {path}: {exc}") from exc
    return destinations_from(document, path)


DESTINATION_KEYS = frozenset(
    {"kind", "url", "secret_file", "secret_env", "timeout", "mode", "concurrency"}
    | {"receipt_lookup", "batch_url", "max_batch_items", "max_batch_bytes", "require_retention"}
)


def destinations_from(document: Mapping[str, Any], path: str | Path) -> dict[str, Destination]:
    """The destinations of a parsed config file (`path` names it in errors)."""
    tables = document.get("destinations")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path}: at least one [destinations.NAME] table is required")
    destinations: dict[str, Destination] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: destinations.{name} must be a table")
        unknown = set(table) - DESTINATION_KEYS
        if unknown:
            raise ConfigError(f"{path}: destinations.{name}: unknown keys {sorted(unknown)}")
        if "url" not in table:
            raise ConfigError(f"{path}: destinations.{name}: url is required")
        secret = None
        if "secret_file" in table:
            secret = read_secret(table["secret_file"])
        elif "secret_env" in table:
            secret = os.environ.get(table["secret_env"])
            if not secret:
                raise ConfigError(f"destinations.{name}: ${table['secret_env']} is not set")
        destinations[name] = Destination(
            kind=table.get("kind", "http"),
            url=table["url"],
            secret=secret,
            timeout=float(table.get("timeout", 10.0)),
            mode=table.get("mode", "single"),
            concurrency=int(table.get("concurrency", Destination.concurrency)),
            receipt_lookup=bool(table.get("receipt_lookup", False)),
            batch_url=table.get("batch_url"),
            max_batch_items=int(table.get("max_batch_items", 500)),
            max_batch_bytes=int(table.get("max_batch_bytes", 1_000_000)),
            require_retention=bool(table.get("require_retention", False)),
        )
    return check_destinations(destinations)


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
