"""The `outbox` command: one entry point with subcommands."""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from typing import Any, NoReturn

import sqlalchemy as sa

from outbox import __version__, failpoints, migrations
from outbox.db.dialect import missing_sqlite_file
from outbox.errors import OutboxError
from outbox.redaction import redact
from outbox_cli import (
    broker,
    console,
    consume,
    dead,
    demo,
    failures,
    operations,
    receiver,
    relay,
    secret,
    settings,
    task,
    upgrades,
    worker,
)
from outbox_cli.config_file import check_document
from outbox_cli.environment import check_environment
from outbox_cli.failures import PortUnavailable
from outbox_cli.logs import report_error, report_stopped
from outbox_cli.own_process import run_as_command
from outbox_cli.stopping import StopSignal, runs_until_stopped, stop_signals_raise
from receiver.errors import StoreUnavailable

DEFAULT_DB = settings.DEFAULT_DB
# Settings each command resolves from flag, environment, config file and default.
OPTIONS = {
    "worker": worker.OPTIONS,
    "relay": relay.OPTIONS,
    "receiver": receiver.OPTIONS,
    "console": console.OPTIONS,
    "task": task.OPTIONS,
}


def _db_argument(parser: argparse.ArgumentParser) -> None:
    """--db and --config: every command that opens the database takes both."""
    parser.add_argument(
        "--db",
        "--url",
        dest="db",
        default=None,
        help=f"database URL (env OUTBOX_DB, or `db` in the config file; default {DEFAULT_DB})",
    )
    parser.add_argument(
        "--config", default=None, help=f"TOML config file (env {settings.CONFIG_ENV})"
    )


class OneLineErrors(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 2, without the usage block.

    Options must be spelled out: with prefix matching, `--secret VALUE` was taken as
    `--secret-file`. An error names the options it refuses, never their values, which
    may be secrets.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """A parser (and, through add_subparsers, its subcommands) without abbreviations."""
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print `prog: error: message` without argument values, and exit 2."""
        if message.startswith("unrecognized arguments: "):
            options = [word for word in message.split()[2:] if word.startswith("-")]
            shown = " ".join(option.partition("=")[0] for option in options)
            message = f"unrecognized arguments: {shown or '(values not shown)'}"
        message = redact(message)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = OneLineErrors(
        prog="outbox",
        description=__doc__,
        epilog=failures.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"outbox-relay {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    db = commands.add_parser("db", help="schema migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="create or upgrade the outbox tables")
    _db_argument(upgrade)
    upgrade.add_argument(
        "--receiver", action="store_true", help="also create or upgrade the receiver tables"
    )
    current = db_commands.add_parser("current", help="show the schema revisions in the database")
    _db_argument(current)
    for parser_ in (upgrade, current):
        parser_.add_argument("--json", action="store_true", help="print JSON instead of text")

    demo.add_arguments(
        commands.add_parser("demo", help="the end-to-end story, on SQLite files by default")
    )
    operations.add_parsers(commands, _db_argument)
    dead.add_parser(commands, _db_argument)
    task.add_parser(commands, _db_argument)
    console.add_parser(commands, _db_argument)
    worker.add_parser(commands, _db_argument)
    relay.add_parser(commands)
    receiver.add_parser(commands)
    secret.add_parser(commands)
    broker.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status. With no `argv`, the process's own
    command line is the command's (the `outbox` script, `python -m outbox_cli`)."""
    if argv is None:
        run_as_command()
    args = build_parser().parse_args(argv)
    try:
        # A service's normal end is a stop signal, whenever it comes (see stopping.py).
        with stop_signals_raise(runs_until_stopped(args)):
            return _run(args)
    except StopSignal as exc:
        name = signal.Signals(exc.signum).name
        report_stopped(f"outbox {_command_name(args)}: stopped by {name}")
        return failures.DONE
    except PortUnavailable as exc:
        report_error(f"outbox: error: {exc}")
        return failures.PORT
    except sa.exc.DBAPIError as exc:
        report_error(f"outbox: error: {failures.database_error(getattr(args, 'db', None), exc)}")
        return failures.DATABASE
    except StoreUnavailable as exc:
        report_error(f"outbox: error: {failures.store_error(getattr(args, 'db', None), exc)}")
        return failures.DATABASE
    except (ValueError, OSError, OutboxError) as exc:
        report_error(f"outbox: error: {exc}")
        return failures.USAGE


def _command_name(args: argparse.Namespace) -> str:
    """The command as typed: `receiver consume`, `worker`."""
    action = getattr(args, "receiver_command", None)
    return f"{args.command} {action}" if action else str(args.command)


def _run(args: argparse.Namespace) -> int:
    """Check the settings, then run the command."""
    if args.command == "receiver":
        consume.refuse_early(args)  # a usage error, named before any file or database
    path = _config_path(args)
    if path:
        check_document(settings.load(path), path, all_options())
    check_environment(os.environ, known_variables(), path)
    failpoints.check()  # a bad value is this one line and status 2, not a failure mid-run
    if args.command == "secret":  # opens no database and reads no settings
        return secret.run(args)
    if args.command == "broker":  # opens no database; reads the relay's settings itself
        return broker.run(args)
    if args.command != "demo":  # the demo makes its own databases unless given --db
        settings.resolve(args, command_options(args.command))
    if getattr(args, "db", None):
        failures.check_database_url(args.db)
    if args.command != "demo":
        missing = None if _creates_schema(args) else missing_sqlite_file(args.db)
        if missing is not None:
            if args.command == "db":  # `db current`: nothing there, so no schema
                return _print_revisions(args, [])
            upgrade = "receiver upgrade" if args.command == "receiver" else "db upgrade"
            raise ValueError(
                f"no SQLite database at {missing}; create it with: outbox {upgrade} --db {args.db}"
            )
    if args.command == "db":
        return _db(args)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "worker":
        return worker.run(args)
    if args.command in ("status", "purge"):
        return operations.run(args)
    if args.command == "dead":
        return dead.run(args)
    if args.command == "task":
        return task.run(args)
    if args.command == "relay":
        return relay.run(args)
    if args.command == "receiver":
        return receiver.run(args)
    if args.command == "console":
        return console.run(args)
    raise AssertionError(f"unhandled command {args.command!r}")


def all_options() -> tuple[settings.Option, ...]:
    """Every setting of every command: what a config file may hold besides destinations."""
    return (settings.DB, *(option for options in OPTIONS.values() for option in options))


def known_variables() -> set[str]:
    """Every OUTBOX_* variable a command reads (destinations' aside)."""
    known = {settings.DB.env, settings.CONFIG_ENV, relay.CONFIG_ENV, receiver.SECRETS_ENV}
    known.add(console.TOKEN_ENV)
    known |= {failpoints.ENV_VAR, failpoints.ACTION_VAR, failpoints.SWITCH_VAR}
    return known | {option.env for options in OPTIONS.values() for option in options}


def _config_path(args: argparse.Namespace) -> str | None:
    """The config file a command reads, if any."""
    return (
        getattr(args, "config", None)
        or os.environ.get(settings.CONFIG_ENV)
        or os.environ.get(relay.CONFIG_ENV)
    )


def command_options(command: str) -> tuple[settings.Option, ...]:
    """The settings `command` resolves: the database, and its own when it declares them."""
    return (settings.DB, *OPTIONS.get(command, ()))


def _creates_schema(args: argparse.Namespace) -> bool:
    """Only the upgrade commands may create a database."""
    action = getattr(args, "db_command", None) or getattr(args, "receiver_command", None)
    return args.command in ("db", "receiver") and action == "upgrade"


def _db(args: argparse.Namespace) -> int:
    if args.db_command == "upgrade":
        branches = [migrations.OUTBOX_BRANCH]
        if args.receiver:
            branches.append(migrations.RECEIVER_BRANCH)
        revisions, changes = upgrades.upgrade(args.db, branches)
        if args.json:
            return _print_revisions(args, revisions)
        print("\n".join(changes))
        return 0
    return _print_revisions(args, migrations.heads_of(args.db))


def _print_revisions(args: argparse.Namespace, revisions: Sequence[str]) -> int:
    if args.json:
        print(json.dumps({"revisions": revisions}))
    else:
        print(", ".join(revisions) or "no schema")
    return 0
