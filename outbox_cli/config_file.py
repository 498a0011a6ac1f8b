"""The config file's shape: `db` at the top, a table per command, `[destinations.NAME]`.

Every key any command reads is known to every command, as one file is shared by the
relay, the worker, the receiver and the console; anything else is refused with the
nearest known name, so a typo never leaves a default silently in force.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from outbox.errors import ConfigError
from outbox.unknown_keys import did_you_mean, refuse_unknown
from outbox_cli.settings import Option
from relay.config import DESTINATION_KEYS

DESTINATIONS = "destinations"
RENAMED = {"relay": {"attempts": "max_attempts"}}
"""Keys of earlier versions, named with what they are called now."""


def check_document(document: Mapping[str, Any], path: str, options: Iterable[Option]) -> None:
    """ConfigError naming the first key or table of `document` that no command reads."""
    top: set[str] = set()
    tables: dict[str, set[str]] = {}
    for option in options:
        table, _, name = option.key.rpartition(".")
        if table:
            tables.setdefault(table, set()).add(name)
        else:
            top.add(name)
    for key, value in document.items():
        if key in top:
            continue  # its value is read, and checked, by settings.resolve
        if key == DESTINATIONS:
            _check_destinations(value, path, DESTINATION_KEYS)
        elif key in tables:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: `{key}` must be a table: [{key}]")
            refuse_unknown(f"{path}: [{key}]", value, tables[key], RENAMED.get(key))
        else:
            raise ConfigError(_unknown_top_level(path, key, value, top, {*tables, DESTINATIONS}))


def _check_destinations(tables: Any, path: str, keys: Collection[str]) -> None:
    """Each [destinations.NAME] a table of known keys."""
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: destinations must be tables [destinations.NAME]")
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: destinations.{name} must be a table")
        refuse_unknown(f"{path}: [destinations.{name}]", table, keys)


def _unknown_top_level(path: str, key: str, value: Any, top: set[str], tables: set[str]) -> str:
    """The refusal of a top-level key or table no command reads, with what was meant."""
    shown = sorted(top) + [f"[{t}.NAME]" if t == DESTINATIONS else f"[{t}]" for t in sorted(tables)]
    known = f"the top level holds {', '.join(shown)}"
    if isinstance(value, dict):
        close = did_you_mean(key, tables)
        if close == DESTINATIONS and value and all(isinstance(v, dict) for v in value.values()):
            first = next(iter(value))
            return f"{path}: unknown table [{key}.{first}] (did you mean [{close}.{first}]?)"
        if close:
            return f"{path}: unknown table [{key}] (did you mean [{close}]?)"
        return f"{path}: unknown table [{key}]; {known}"
    close = did_you_mean(key, top | tables)
    if close:
        return f"{path}: unknown key `{key}` (did you mean `{close}`?)"
    return f"{path}: unknown key `{key}`; {known}"
