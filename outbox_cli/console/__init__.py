"""`outbox console`: a web page for operators: the backlog, dead replies, and their requeue.

It binds to loopback unless told otherwise; anywhere else it refuses to start
without a token (OUTBOX_CONSOLE_TOKEN), which every request must then carry.
A requeue from the page is `outbox dead requeue`'s: the receipt lookup first
(the destinations read from --config, as the relay reads them), a refusal unless
confirmed on the page that refused it, an audit row with the operator's name: the
name given at login, or without a token, --operator. --read-only hides it.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from outbox_cli.arguments import boolean, operator_name, positive_int
from outbox_cli.logs import announce, configure_logging
from outbox_cli.ports import listening_socket
from outbox_cli.settings import Option, add_flags

log = logging.getLogger("outbox.console")

LOOPBACK = "127.0.0.1"
TOKEN_ENV = "OUTBOX_CONSOLE_TOKEN"  # noqa: S105 (the variable that holds it)
SHORTEST_TOKEN = 16
OPTIONS = (
    Option.of("console", "host", default=LOOPBACK),
    Option.of("console", "port", positive_int, 8080),
    Option.of("console", "read_only", boolean, False),
    Option.of("console", "operator", operator_name),
    # The worker's setting, read from the same place: a task the console cancels has its
    # reply sent where the worker sends the others.
    Option.of("worker", "reply_destination", default="default"),
)
HELP = {
    "host": f"address to listen on (default {LOOPBACK}; elsewhere {TOKEN_ENV} is required)",
    "port": "port to listen on (default 8080)",
    "operator": "who requeues, for the audit, when no token is set (with one, each operator "
    "gives a name at login); without either, requeues are refused",
    "reply_destination": "where a task cancelled here sends its reply, as the worker's "
    "(default: default)",
}


def add_parser(commands: Any, db_argument: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `outbox console`."""
    parser = commands.add_parser(
        "console",
        help="operator web console: backlog, dead replies, requeue",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    db_argument(parser)
    add_flags(parser, [option for option in OPTIONS if option.dest != "read_only"], HELP)
    parser.add_argument(
        "--read-only",
        action="store_const",
        const=True,
        default=None,
        help="show everything, change nothing: no requeue (env OUTBOX_CONSOLE_READ_ONLY)",
    )


def console_token(host: str) -> str | None:
    """The token every request must carry: required off loopback, optional on it."""
    from outbox_cli.console.hosts import is_loopback

    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        raise ValueError(
            f"the console listens on {host}, not loopback: set {TOKEN_ENV} to a token "
            "every request must carry"
        )
    if token is not None and len(token.strip()) < SHORTEST_TOKEN:
        raise ValueError(f"{TOKEN_ENV} must be at least {SHORTEST_TOKEN} characters")
    return token


def run(args: argparse.Namespace) -> int:
    """Serve the console until interrupted; returns the exit status."""
    import uvicorn

    from outbox.operations import Operations
    from outbox_cli.console.app import create_app
    from outbox_cli.console.requeue_form import check_config
    from receiver.protocol import http_settings
    from receiver.request_guard import DEFAULT_HEADER_LIMIT

    token = console_token(args.host)
    configure_logging("text")
    announce("console", args.db, args.config)
    if token is not None and args.operator is not None:
        log.warning(
            "console: --operator is not used: with a token, each operator names themselves at login"
        )
    with Operations(args.db) as ops:
        check_config(args.config)
        app = create_app(
            ops,
            config=args.config,
            token=token,
            read_only=args.read_only,
            host=args.host,
            operator=args.operator,
            reply_destination=args.reply_destination,
            # Before the port opens: the operator's first look does not wait for a day of
            # chart counts to be read.
            warm=True,
        )
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            ws="none",
            # The receiver's header limit, so that httptools (the `fast` extra) and h11
            # refuse the same requests; no deadline: a browser keeps idle connections.
            **http_settings(DEFAULT_HEADER_LIMIT, request_timeout=None),
        )
        # Bound before the "console on" line: a port in use is named, never announced.
        sock = listening_socket(args.host, args.port)
        try:
            log.info(
                "console on http://%s:%d%s%s",
                args.host,
                args.port,
                " (read-only)" if args.read_only else "",
                " (token required)" if token else "",
            )
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            sock.close()
    return 0
