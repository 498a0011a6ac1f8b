"""`outbox relay`: run the relay sidecar from a TOML file, the environment, or both.

`[destinations.NAME]` tables, or OUTBOX_DESTINATION_<NAME>_<KEY> variables (which
win key by key), say where messages go, so a container needs no file. Every
`[relay]` setting is also a flag and an OUTBOX_RELAY_* variable, resolved like
every other command's settings (flag, environment, file, default).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from outbox.observability.server import DEFAULT_HOST
from outbox.unknown_keys import refuse_unknown
from outbox_cli.arguments import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from outbox_cli.config_file import RENAMED
from outbox_cli.logs import LOG_HELP, announce, configure_logging, log_options
from outbox_cli.own_process import tune_if_own_process
from outbox_cli.ports import metrics_server
from outbox_cli.settings import Option, add_flags, load
from relay import Relay
from relay.config import destinations_from

CONFIG_ENV = "OUTBOX_RELAY_CONFIG"


# The Relay's own settings: absent ones take the Relay's defaults.
RELAY_OPTIONS = (
    Option.of("relay", "owner"),
    Option.of("relay", "lease", positive_float),
    Option.of("relay", "backoff", positive_float),
    Option.of("relay", "backoff_cap", positive_float),
    Option.of("relay", "max_attempts", positive_int),
    Option.of("relay", "batch", positive_int),
    Option.of("relay", "concurrency", positive_int),
    Option.of("relay", "poll_interval", positive_float),
    Option.of("relay", "grace", non_negative_float),
)
OPTIONS = (
    *RELAY_OPTIONS,
    Option.of("relay", "metrics_port", non_negative_int),
    Option.of("relay", "metrics_host", default=DEFAULT_HOST),
    *log_options("relay"),
)
"""Every `outbox relay` setting: a flag, an OUTBOX_RELAY_* variable, or relay.* in the file."""

HELP = {
    "owner": "this relay's lease owner name, unique per replica (default: host, pid, random)",
    "lease": "seconds; longer than every destination timeout (default 30)",
    "backoff": "first retry delay in seconds; doubles, jittered (default 2)",
    "backoff_cap": "longest retry delay in seconds (default 300)",
    "max_attempts": "delivery attempts per message (default 3)",
    "batch": "messages claimed per turn (default 100)",
    "concurrency": "requests in flight, all destinations (default 32)",
    "poll_interval": "seconds between looks for work without NOTIFY (default 1)",
    "grace": "SIGTERM drain in seconds, 0 for none (default: the lease)",
    "metrics_port": "serve /metrics, /healthz (liveness), /readyz on this port (0: off)",
    "metrics_host": f"address the metrics port binds (default {DEFAULT_HOST}; 0.0.0.0 for all)",
    **LOG_HELP,
}


RELAY_KEYS = frozenset(option.dest for option in OPTIONS)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `outbox relay`; its settings are filled in later (see outbox_cli.settings)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "relay", help="deliver outbox messages over signed HTTP until SIGTERM"
    )
    parser.add_argument(
        "--db", default=None, help="database URL (env OUTBOX_DB, or `db` in the config file)"
    )
    parser.add_argument(
        "--config",
        default=os.environ.get(CONFIG_ENV) or None,
        help="TOML file with [relay] settings and [destinations.NAME] tables "
        f"(env {CONFIG_ENV} or OUTBOX_CONFIG); optional when OUTBOX_DESTINATION_<NAME>_<KEY> "
        "variables define the destinations",
    )
    add_flags(parser, OPTIONS, HELP)
    return parser


def check_relay_table(document: dict[str, Any], path: str | None) -> None:
    """ConfigError naming any key of the file's [relay] table that is not a relay setting
    (outbox_cli.config_file checks the whole file so for every command)."""
    refuse_unknown(f"{path}: [relay]", document.get("relay", {}), RELAY_KEYS, RENAMED["relay"])


def run(args: argparse.Namespace) -> int:
    """Run the relay until SIGTERM; exit 0 after draining."""
    path = args.config or os.environ.get("OUTBOX_CONFIG")
    document = load(path) if path else {}
    destinations = destinations_from(document, path, os.environ)
    configure_logging(args.log_format, args.log_level)
    announce("relay", args.db, path)
    options = {
        option.dest: getattr(args, option.dest)
        for option in RELAY_OPTIONS
        if getattr(args, option.dest) is not None
    }
    with Relay(args.db, destinations, **options) as relay:
        server = None
        if args.metrics_port:
            server = metrics_server(
                args,
                render=relay.metrics.render,
                health=relay.health,
                ready=relay.readiness,
            ).start()
        try:
            tune_if_own_process()
            relay.run()
        finally:
            if server is not None:
                server.close()
    return 0
