"""`outbox relay`: run the relay sidecar from a TOML configuration file."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from relay.config import ConfigError, load_toml

SETTINGS = {
    "owner": str,
    "lease": float,
    "backoff": float,
    "backoff_cap": float,
    "attempts": int,
    "batch": int,
    "concurrency": int,
    "poll_interval": float,
    "grace": float,
}


class JsonFormatter(logging.Formatter):
    """One JSON object per log line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        """Render a record as JSON."""
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


def configure_logging(log_format: str, level: str = "INFO") -> None:
    """Logs to stderr, as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiohttp logs each dropped keep-alive connection; those are retried, not news.
    logging.getLogger("aiohttp").setLevel(logging.WARNING)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `outbox relay`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "relay", help="deliver outbox messages over signed HTTP until SIGTERM"
    )
    parser.add_argument(
        "--db", default=None, help="database URL (env OUTBOX_DB, or `db` in the config file)"
    )
    parser.add_argument(
        "--config",
        default=os.environ.get("OUTBOX_RELAY_CONFIG") or os.environ.get("OUTBOX_CONFIG"),
        help="TOML file with [relay] settings and [destinations.NAME] tables "
        "(env OUTBOX_RELAY_CONFIG or OUTBOX_CONFIG)",
    )
    parser.add_argument("--owner", help="this relay's lease owner name (overrides the file)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("OUTBOX_RELAY_METRICS_PORT", "0")) or None,
        help="serve Prometheus metrics and /healthz on this port (env OUTBOX_RELAY_METRICS_PORT)",
    )
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--log-level", default="INFO")
    return parser


def relay_options(settings: dict[str, Any]) -> dict[str, Any]:
    """Typed Relay keyword arguments from the file's [relay] table."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ConfigError(f"[relay]: unknown keys {sorted(unknown)}; known: {sorted(SETTINGS)}")
    options: dict[str, Any] = {}
    for key, value in settings.items():
        kind = SETTINGS[key]
        if isinstance(value, bool) or not isinstance(value, kind | int):
            raise ConfigError(f"[relay] {key} must be {kind.__name__}, got {value!r}")
        options[key] = kind(value)
    return options


def run(args: argparse.Namespace) -> int:
    """Run the relay until SIGTERM; exit 0 after draining."""
    if not args.config:
        raise ConfigError("--config (or OUTBOX_RELAY_CONFIG, or OUTBOX_CONFIG) is required")
    configure_logging(args.log_format, args.log_level)
    settings, destinations = load_toml(args.config)
    options = relay_options(settings)
    if args.owner:
        options["owner"] = args.owner
    from relay.runner import Relay

    with Relay(args.db, destinations, metrics_port=args.metrics_port, **options) as relay:
        relay.run()
    return 0
