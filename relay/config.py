"""Relay configuration: destinations by name, validated once at start.

Destinations come only from configuration; a message names one, never a URL.
Secrets are read from files or the environment, never from flag values that
would show up in `ps`. A table's keys every kind has go to Destination, its kind's
own to the options class the registry (relay.transports.KINDS) names for it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from outbox.errors import ConfigError
from outbox.messages import check_destination
from outbox.redaction import shown_value
from outbox.unknown_keys import refuse_unknown
from relay.destination import COMMON_KEYS, KindOptions, Reader, check_url
from relay.destination import Destination as Destination  # still importable from here
from relay.transports import KINDS


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


# Each key of a [destinations.NAME] table (or OUTBOX_DESTINATION_NAME_KEY variable) and
# how its value is read: TOML gives typed values, the environment gives text.
DESTINATION_KEYS: dict[str, Reader] = {
    **COMMON_KEYS,
    **{key: read for kind in KINDS.values() for key, read in kind.options.KEYS.items()},
}
DEFAULT_KIND = "http"
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
        {name: _destination(name, where, table, environ) for name, (where, table) in merged.items()}
    )


def _destination(
    name: str, where: str, table: Mapping[str, Any], environ: Mapping[str, str]
) -> Destination:
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
    kind = values.pop("kind", DEFAULT_KIND)
    if kind not in KINDS:
        # As the relay refused it at start before kinds were read with their keys.
        raise ConfigError(f"destination {name!r}: kind {kind!r} is not one of {sorted(KINDS)}")
    try:
        return make_destination(values.pop("url"), kind=kind, **values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def make_destination(url: str, *, kind: str = DEFAULT_KIND, **keys: Any) -> Destination:
    """The destination a [destinations.NAME] table describes, from its keys' typed values
    (the secret itself, not where to read it): the keys every kind has go to Destination,
    the kind's own to its options class (relay.transports.KINDS). A key of another kind is
    refused, but HTTP's at their defaults; ConfigError names what is wrong."""
    if not isinstance(kind, str):
        raise ConfigError(f"destination kind must be a name, got {shown_value(kind)}")
    if kind not in KINDS:
        raise ConfigError(f"kind {kind!r} is not one of {sorted(KINDS)}")
    options_class = KINDS[kind].options
    # The URL first, as before kinds had options of their own: the first error stays the same.
    check_url(url, options_class)
    own = {key: keys.pop(key) for key in list(keys) if key in options_class.KEYS}
    for field in dataclasses.fields(options_class):
        if field.name not in own and field.default is dataclasses.MISSING:
            raise ConfigError(f"a destination of kind {kind} needs {field.name}")
    for key in [key for key in keys if key not in COMMON_KEYS]:
        owner = next((other for other in KINDS.values() if key in other.options.KEYS), None)
        if owner is None:
            continue  # not a destination key at all: Destination refuses it
        value = keys.pop(key)
        # HTTP's options at their defaults passed on any kind before kinds had options of
        # their own (one flat table could not tell them from absent): still tolerated.
        # Any other kind's key given at all is refused.
        if owner.options.KIND != "http" or value != _default(owner.options, key):
            raise ConfigError(f"{key} is a key of {owner.options.KIND} destinations, not of {kind}")
    return Destination(url, options_class(**own), **keys)


def _default(options_class: type[KindOptions], key: str) -> object:
    """The default of one of a kind's keys; MISSING when the kind requires it."""
    return {f.name: f.default for f in dataclasses.fields(options_class)}[key]


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
