"""`outbox receiver`: serve the reference receiver, upgrade its tables, purge old receipts.

    outbox receiver --db URL --port N --secret-file PATH [--host 127.0.0.1] [--workers N]
    outbox receiver upgrade --db URL
    outbox receiver purge --db URL --older-than 30d [--retention 30d]
    outbox receiver consume --db URL --from nats://HOST:PORT --stream S --durable D
    outbox receiver consume --db URL --from amqp://USER:PASS@HOST:PORT/ --queue Q
    outbox receiver dead list|show REPLY_ID|retry REPLY_ID|purge (REPLY_ID | --older-than D)

Secrets come from a file (one ``whsec_...`` per line; blank lines and ``#``
comments ignored) or from ``OUTBOX_RECEIVER_SECRETS`` (comma-separated), never
from a flag value, which any user could read in ``ps``. Several secrets are
accepted at once so they can be rotated.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from outbox.durations import duration_text
from outbox.migrations import RECEIVER_BRANCH
from outbox.process_gc import tune_for_long_run
from outbox.signing import DEFAULT_TOLERANCE
from outbox_cli import consume, processes, receiver_dead, upgrades
from outbox_cli.arguments import boolean, parse_duration, positive_float, positive_int
from outbox_cli.logs import LOG_HELP, announce, configure_logging, log_options
from outbox_cli.own_process import tune_if_own_process
from outbox_cli.ports import listening_socket
from outbox_cli.settings import Option, add_flags, config_path
from outbox_cli.stopping import sigterm_ends
from receiver.app import DEFAULT_MAX_BODY
from receiver.request_guard import DEFAULT_HEADER_LIMIT, DEFAULT_REQUEST_TIMEOUT

DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_KEEP_ALIVE = 5.0

if TYPE_CHECKING:
    import uvicorn

    from receiver.store import ReceiptStore

SECRETS_ENV = "OUTBOX_RECEIVER_SECRETS"


def load_secrets(secret_file: str | None) -> list[str]:
    """Secrets from the file if given, else from OUTBOX_RECEIVER_SECRETS; ValueError if none."""
    if secret_file is not None:
        lines = Path(secret_file).read_text(encoding="utf-8").splitlines()
        secrets = [line.strip() for line in lines]
        secrets = [s for s in secrets if s and not s.startswith("#")]
        where = secret_file
    else:
        secrets = [s.strip() for s in os.environ.get(SECRETS_ENV, "").split(",") if s.strip()]
        where = SECRETS_ENV
    if not secrets:
        raise ValueError(
            f"no webhook secret in {where}: give --secret-file PATH or set {SECRETS_ENV}"
        )
    return secrets


def _db_argument(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--db",
        "--url",
        dest="db",
        default=default,
        help="database URL (env OUTBOX_DB, or `db` in the config file; default sqlite:///outbox.db)",
    )


SERVING_OPTIONS = (
    Option.of("receiver", "host", default="127.0.0.1"),
    Option.of("receiver", "port", int, 8000),
    Option.of("receiver", "secret_file"),
    Option.of("receiver", "tolerance", parse_duration, float(DEFAULT_TOLERANCE)),
    Option.of("receiver", "max_body", positive_int, DEFAULT_MAX_BODY),
    Option.of("receiver", "retention", parse_duration),
    Option.of("receiver", "header_limit", positive_int, DEFAULT_HEADER_LIMIT),
    Option.of("receiver", "request_timeout", positive_float, DEFAULT_REQUEST_TIMEOUT),
    Option.of("receiver", "max_connections", positive_int, DEFAULT_MAX_CONNECTIONS),
    Option.of("receiver", "keep_alive", positive_float, DEFAULT_KEEP_ALIVE),
    Option.of("receiver", "body_budget", positive_int),
    Option.of("receiver", "workers", positive_int, 1),
    Option.of("receiver", "continue_traces", boolean, False),
    *log_options("receiver"),
)
"""Serving settings: each a flag, an OUTBOX_RECEIVER_* variable, or receiver.* in the file."""
OPTIONS = (*SERVING_OPTIONS, *consume.OPTIONS)
"""Every `outbox receiver` setting, `consume`'s included (their flags are on `consume`)."""

HELP = {
    "host": "address to bind (default 127.0.0.1)",
    "port": "port to bind (default 8000)",
    "secret_file": f"file with one whsec_ secret per line (else env {SECRETS_ENV})",
    "tolerance": "signature timestamp tolerance (default 300s)",
    "max_body": "largest body in bytes (default 1 MiB)",
    "retention": "receipt retention to publish (default 30d)",
    "header_limit": "largest request header block in bytes; over it: 431 (default 64 KiB)",
    "request_timeout": "seconds to receive a whole request; past it: 408 and close (default 10)",
    "max_connections": "open connections served; requests over it get 503 (default 1000)",
    "keep_alive": "seconds an idle connection stays open between requests (default 5)",
    "body_budget": "request body bytes buffered at once; over it: 503 + Retry-After "
    "(default 64 MiB, at least max_body)",
    "workers": "processes serving the port, each with its own database pool and limits (default 1)",
    "continue_traces": "a single message's process span (a batch of one, consuming) continues "
    "the publisher's trace instead of linking to it (docs/how-to/tracing.md)",
    **LOG_HELP,
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `receiver` subcommand on the `outbox` command's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "receiver",
        help="run the reference receiver (or: receiver upgrade | purge | consume | dead)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _db_argument(parser, None)  # resolved later: flag, OUTBOX_DB, config file, default
    parser.add_argument(
        "--config",
        default=None,
        help="TOML config file with a [receiver] table (env OUTBOX_CONFIG)",
    )
    add_flags(parser, SERVING_OPTIONS, HELP)
    consume.add_early_flags(parser)
    actions = parser.add_subparsers(dest="receiver_command", metavar="{upgrade,purge,consume,dead}")
    # SUPPRESS: an option given before the action ("receiver --db X purge") must survive.
    upgrade = actions.add_parser("upgrade", help="create or upgrade the receiver tables")
    _db_argument(upgrade, argparse.SUPPRESS)
    purge = actions.add_parser("purge", help="delete receipts older than a duration")
    _db_argument(purge, argparse.SUPPRESS)
    purge.add_argument(
        "--older-than", type=parse_duration, required=True, help="e.g. 30d, 12h, 90m"
    )
    purge.add_argument(
        "--retention",
        type=parse_duration,
        default=argparse.SUPPRESS,
        help="the published retention (default 30d); purging younger receipts is refused",
    )
    purge.add_argument("--batch", type=int, default=1000, help="rows deleted per transaction")
    shared = [
        o
        for o in SERVING_OPTIONS
        if o.dest in ("secret_file", "log_format", "log_level", "continue_traces")
    ]
    consume.add_parser(actions, _db_argument, shared, HELP)
    receiver_dead.add_parser(actions, _db_argument)
    return parser


def run(args: argparse.Namespace, *, receipts_only: bool = False) -> int:
    """Run `outbox receiver ...` from parsed arguments; returns the exit status.

    `receipts_only` serves without the reference effect: the benchmarks' comparison
    with a bare receiver, which stores receipts and nothing else.
    """
    from receiver.store import DEFAULT_RETENTION, ReceiptStore

    retention = DEFAULT_RETENTION if args.retention is None else args.retention
    if args.receiver_command == "upgrade":
        _, changes = upgrades.upgrade(args.db, [RECEIVER_BRANCH])
        print("\n".join(changes))
        return 0
    if args.receiver_command == "purge":
        with ReceiptStore(args.db, retention=retention) as store:
            removed = store.purge(args.older_than, batch=args.batch)
        print(f"purged {removed} receipt(s) older than {duration_text(args.older_than)}")
        return 0
    if args.receiver_command == "consume":
        return consume.run(args, load_secrets)
    if args.receiver_command == "dead":
        return receiver_dead.run(args)
    return _serve(args, Serving(retention, not receipts_only))


class Serving(NamedTuple):
    """What every serving process takes besides the arguments."""

    retention: float
    reference_effect: bool
    """Whether each first receipt runs the reference effect (the command always does)."""


def _serve(args: argparse.Namespace, serving: Serving) -> int:
    from receiver.store import ReceiptStore

    secrets = load_secrets(args.secret_file)
    configure_logging(args.log_format, args.log_level)
    announce("receiver", args.db, config_path(args))
    listening = logging.getLogger("outbox.receiver")
    retention = serving.retention
    fields = {"host": args.host, "port": args.port, "retention": retention}
    kept = f"retention {duration_text(retention)}, {len(secrets)} secret(s)"
    # Bound before anything says "listening": a port in use is named, not found by a client.
    sock = listening_socket(args.host, args.port)
    try:
        if args.workers == 1:
            server, store = _server(args, serving, secrets)
            try:
                listening.info(
                    "receiver listening on http://%s:%d (%s)",
                    args.host,
                    args.port,
                    kept,
                    extra={"fields": fields},
                )
                tune_if_own_process()
                server.run(sockets=[sock])
            finally:
                store.close()
            return 0
        # Each worker opens its own store; this one only says now, once, if the database
        # is not ready, rather than in every worker.
        ReceiptStore(args.db, retention=retention).close()
        listening.info(
            "receiver listening on http://%s:%d with %d worker processes (%s)",
            args.host,
            args.port,
            args.workers,
            kept,
            extra={"fields": {**fields, "workers": args.workers}},
        )
        return processes.serve_in_processes(args.workers, _worker, sock, (args, serving))
    finally:
        sock.close()


def _worker(sock: socket.socket, settings: tuple[argparse.Namespace, Serving]) -> None:
    """One of `--workers` processes: serve the parent's socket until SIGTERM."""
    args, serving = settings
    # uvicorn raises the SIGTERM it caught again once it has shut down: it ends the block
    # here, and the process exits through its exit handlers (stopping.py).
    with sigterm_ends():
        configure_logging(args.log_format, args.log_level)
        server, store = _server(args, serving, load_secrets(args.secret_file))
        try:
            # A worker process of the command's own, whoever started the command.
            tune_for_long_run()
            server.run(sockets=[sock])
        finally:
            store.close()


def _server(
    args: argparse.Namespace, serving: Serving, secrets: list[str]
) -> tuple[uvicorn.Server, ReceiptStore]:
    """The reference receiver as a uvicorn server, and the store it answers from."""
    import uvicorn

    from receiver.app import create_app
    from receiver.effects import record_effect
    from receiver.protocol import http_settings
    from receiver.store import ReceiptStore

    store = ReceiptStore(args.db, retention=serving.retention)
    try:
        app = create_app(
            store,
            secrets,
            tolerance=args.tolerance,
            max_body=args.max_body,
            effect=record_effect if serving.reference_effect else None,
            body_budget=args.body_budget,
            continue_traces=args.continue_traces,
        )
        # uvicorn's loggers go through ours (log_config=None: it installs no handlers), so
        # its lines are JSON too; one line per request would cost more than /metrics tells.
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            # No route is a websocket: an upgrade would leave the guarded protocol's limits.
            ws="none",
            # Each limit bounds what a client without credentials can make the process hold.
            limit_concurrency=args.max_connections,
            timeout_keep_alive=args.keep_alive,
            **http_settings(args.header_limit, args.request_timeout),
        )
    except BaseException:
        store.close()
        raise
    return uvicorn.Server(config), store
