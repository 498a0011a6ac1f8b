"""`outbox broker setup`: create the JetStream streams and RabbitMQ exchanges (and queues)
the relay's destinations need, from the relay's own configuration.

Destinations are read exactly as `outbox relay` reads them (the TOML file's
`[destinations.NAME]` tables and OUTBOX_DESTINATION_<NAME>_<KEY> variables), and
the duplicate window a stream needs is the retry window the relay's start check
requires, from the same `[relay]` settings. Exit status: 0 when everything is in
place, 1 when a broker cannot be reached or refuses, 2 for bad configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from outbox.errors import ConfigError
from outbox_cli import relay
from outbox_cli.logs import report_error
from outbox_cli.settings import CONFIG_ENV, add_flags, load, resolve
from relay import Relay
from relay.broker_setup import Change
from relay.config import Destination, destinations_from
from relay.errors import SetupRefused, TransportError
from relay.nats_setup import set_up_stream
from relay.policy import retry_window
from relay.rabbitmq_setup import (
    DEFAULT_EXCHANGE_TYPE,
    EXCHANGE_TYPES,
    QueueBinding,
    set_up_exchange,
)
from relay.transports import check_kinds

WINDOW_OPTIONS = tuple(
    option
    for option in relay.RELAY_OPTIONS
    if option.dest in ("max_attempts", "backoff", "backoff_cap", "lease")
)
"""The relay settings its retry window depends on: flag, OUTBOX_RELAY_* or [relay] in the file."""
CLIENT_LOGGERS = ("nats", "aio_pika", "aiormq")
"""The broker clients' loggers."""
_RELAY_DEFAULTS = inspect.signature(Relay).parameters
"""The Relay's own defaults for settings left unset, so the window is the one it checks."""


def add_parser(commands: Any) -> None:
    """Register `outbox broker setup`."""
    broker = commands.add_parser(
        "broker", help="create the NATS streams and RabbitMQ exchanges the relay needs"
    )
    actions = broker.add_subparsers(dest="broker_command", required=True)
    setup = actions.add_parser(
        "setup",
        help="create or update each destination's JetStream stream or RabbitMQ exchange "
        "(never shrinks or deletes anything)",
        description="A NATS destination's stream is created or updated to capture its subject "
        "with a duplicate window at least the relay's longest retry window, which follows "
        "the relay's --max-attempts, --backoff, --backoff-cap and --lease (set them here as "
        "the relay runs, or in [relay] or OUTBOX_RELAY_*). A RabbitMQ destination's exchange "
        "is declared durable, and with --queue a durable queue bound to it. Exit status: "
        "0 done, 1 a broker unreachable or refusing, 2 bad configuration.",
    )
    setup.add_argument(
        "--config",
        default=os.environ.get(relay.CONFIG_ENV) or None,
        help="the relay's TOML file (env "
        f"{relay.CONFIG_ENV} or {CONFIG_ENV}); optional when OUTBOX_DESTINATION_<NAME>_<KEY> "
        "variables define the destinations",
    )
    setup.add_argument(
        "--destination",
        action="append",
        dest="chosen",
        metavar="NAME",
        help="set up only this destination (repeatable; default: every one)",
    )
    setup.add_argument(
        "--exchange-type",
        choices=EXCHANGE_TYPES,
        default=DEFAULT_EXCHANGE_TYPE,
        help=f"type of a RabbitMQ exchange to declare (default {DEFAULT_EXCHANGE_TYPE})",
    )
    setup.add_argument(
        "--queue",
        help="also declare this durable queue and bind it to each RabbitMQ destination's exchange",
    )
    setup.add_argument(
        "--binding",
        metavar="KEY",
        help="the queue's binding key (default: the routing key with each word that holds "
        "{ordering_key} as #, e.g. orders.#)",
    )
    setup.add_argument(
        "--dry-run", action="store_true", help="say what would change, and change nothing"
    )
    add_flags(setup, WINDOW_OPTIONS, relay.HELP)


def run(args: argparse.Namespace) -> int:
    """Set up the chosen destinations, one line per thing; returns the exit status."""
    path = args.config or os.environ.get(CONFIG_ENV)
    document = load(path) if path else {}
    # The file is the relay's: a [relay] typo here would size the window on a default.
    relay.check_relay_table(document, path)
    destinations = _chosen(destinations_from(document, path, os.environ), args.chosen)
    check_kinds(destinations)
    resolve(args, WINDOW_OPTIONS)
    if args.binding is not None and args.queue is None:
        raise ConfigError("--binding needs --queue: it is the key that queue is bound with")
    if args.queue is not None and not any(d.kind == "rabbitmq" for d in destinations.values()):
        raise ConfigError("--queue binds to RabbitMQ exchanges, and no chosen destination has one")
    window = retry_window(
        *(_setting(args, name) for name in ("max_attempts", "backoff", "backoff_cap", "lease"))
    )
    queue = None if args.queue is None else QueueBinding(args.queue, args.binding)
    for client in CLIENT_LOGGERS:
        # Their records repeat the one-line error this command prints; with no handler
        # anywhere, Python's last resort would print them to stderr as well.
        logging.getLogger(client).addHandler(logging.NullHandler())
    try:
        asyncio.run(_set_up(destinations, window, args.exchange_type, queue, args.dry_run))
    except (SetupRefused, TransportError) as exc:
        report_error(f"outbox: error: {exc}")
        return 1
    return 0


def _chosen(
    destinations: dict[str, Destination], names: list[str] | None
) -> dict[str, Destination]:
    """The destinations named by --destination, or all of them."""
    if not names:
        return destinations
    unknown = [name for name in names if name not in destinations]
    if unknown:
        raise ConfigError(
            f"no destination {', '.join(map(repr, unknown))}; the configured ones are "
            f"{', '.join(sorted(destinations))}"
        )
    return {name: destinations[name] for name in dict.fromkeys(names)}


def _setting(args: argparse.Namespace, name: str) -> Any:
    """A window setting as resolved, or the Relay's default when nothing set it."""
    value = getattr(args, name)
    return _RELAY_DEFAULTS[name].default if value is None else value


async def _set_up(
    destinations: dict[str, Destination],
    window: Callable[[Destination], float],
    exchange_type: str,
    queue: QueueBinding | None,
    dry_run: bool,
) -> None:
    """Each destination in turn, its lines printed as soon as it is done."""
    for name, destination in destinations.items():
        changes: list[Change]
        if destination.kind == "nats":
            changes = [await set_up_stream(destination, window(destination), dry_run)]
        elif destination.kind == "rabbitmq":
            changes = await set_up_exchange(destination, exchange_type, queue, dry_run)
        else:
            changes = [Change(f"{destination.kind} destination", "nothing to set up")]
        for change in changes:
            print(f"{name}: {change.line(dry_run)}", flush=True)
