"""Settings of the `outbox` commands: flag, then environment, then config file, then default.

The config file is TOML, named by `--config` or OUTBOX_CONFIG. It holds `db` at the
top and a table per command: `[worker]` here; the relay reads its `[relay]` and
`[destinations.NAME]` tables from the same file. Every setting also has an
OUTBOX_* environment variable, for containers.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.redaction import shown_value
from outbox_cli.arguments import boolean

CONFIG_ENV = "OUTBOX_CONFIG"
DEFAULT_DB = "sqlite:///outbox.db"


@dataclass(frozen=True)
class Option:
    """One setting: where a command finds it when its flag is not given."""

    dest: str  # the argparse destination; the flag is --dest with dashes
    env: str
    key: str  # "db", or "table.name" in the config file
    parse: Callable[[str], Any] = str
    default: Any = None
    required: bool = False

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return "--" + self.dest.replace("_", "-")

    @classmethod
    def of(
        cls,
        command: str,
        dest: str,
        parse: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
    ) -> Option:
        """A setting of `command`: variable OUTBOX_COMMAND_DEST, key command.dest in the file."""
        env = f"OUTBOX_{command.upper()}_{dest.upper()}"
        return cls(dest, env, f"{command}.{dest}", parse, default, required)


def add_flags(
    parser: argparse.ArgumentParser,
    options: Sequence[Option],
    helps: dict[str, str],
    absent: Any = None,
) -> None:
    """A flag per option, `absent` unless given (argparse.SUPPRESS on a subcommand, so a
    value given before it survives): resolve() fills in the rest after parsing. A
    true-or-false option is a switch: given, it is true."""
    for option in options:
        if option.parse is boolean:
            parser.add_argument(
                option.flag,
                action="store_const",
                const=True,
                default=absent,
                help=f"{helps[option.dest]} (env {option.env})",
            )
            continue
        parser.add_argument(
            option.flag,
            type=option.parse,
            default=absent,
            help=f"{helps[option.dest]} (env {option.env})",
        )


DB = Option("db", "OUTBOX_DB", "db", default=DEFAULT_DB)


def config_path(args: argparse.Namespace) -> str | None:
    """The config file a command reads: --config, else OUTBOX_CONFIG, else none."""
    return getattr(args, "config", None) or os.environ.get(CONFIG_ENV) or None


def resolve(args: argparse.Namespace, options: Sequence[Option]) -> None:
    """Fill each option missing from the command line; ValueError names a bad source."""
    path = config_path(args)
    document = load(path) if path else {}
    for option in options:
        if getattr(args, option.dest, None) is not None:
            continue  # given as a flag
        value, source = _lookup(option, document, path)
        if value is None:
            if option.required:
                raise ValueError(
                    f"{option.flag} is required (or {option.env}, or {option.key} in the "
                    f"config file)"
                )
            setattr(args, option.dest, option.default)
            continue
        try:
            setattr(args, option.dest, option.parse(str(value)))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from exc


def load(path: str) -> dict[str, Any]:
    """The config file as a dict; ValueError when it cannot be read or parsed."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read config file {path}: {exc}") from exc


def _lookup(option: Option, document: dict[str, Any], path: str | None) -> tuple[Any, str]:
    """(value, where it came from), or (None, "") when neither environment nor file has it."""
    if os.environ.get(option.env):
        return os.environ[option.env], option.env
    table: Any = document
    for part in option.key.split("."):
        table = table.get(part) if isinstance(table, dict) else None
    if table is None:
        return None, ""
    where = f"{path}: {option.key}"
    if isinstance(table, bool):
        return str(table).lower(), where  # read as the environment's text would be
    if not isinstance(table, str | int | float):
        raise ValueError(f"{where}: expected a string or a number, got {shown_value(table)}")
    return table, where
