"""`outbox worker`: run a handler (module:function) over claimed tasks until SIGTERM."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from outbox.handlers import WrongHandlerKind, is_async_handler
from outbox.observability.server import DEFAULT_HOST
from outbox.observability.worker_metrics import WorkerMetrics
from outbox.tasks import TaskQueue
from outbox.worker import Handler, Worker
from outbox_cli.arguments import non_negative_int, positive_float, positive_int
from outbox_cli.logs import LOG_HELP, announce, configure_logging, log_options, report_error
from outbox_cli.own_process import tune_if_own_process
from outbox_cli.ports import metrics_server
from outbox_cli.settings import Option, add_flags, config_path


def load_handler(spec: str) -> Handler:
    """The callable named by "package.module:function" (argparse type: bad names exit 2)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise argparse.ArgumentTypeError(f"expected module:function, got {spec!r}")
    # As uvicorn and gunicorn do: the application's modules are found from where it runs.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot load {spec!r}: {exc}") from exc
    if not callable(target):
        raise argparse.ArgumentTypeError(f"{spec!r} is not callable")
    try:
        is_async_handler(target)
    except WrongHandlerKind as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    handler: Handler = target
    return handler


OPTIONS = (
    Option.of("worker", "handler", load_handler, required=True),
    Option.of("worker", "concurrency", positive_int, 1),
    Option.of("worker", "owner"),
    Option.of("worker", "lease", positive_float, 30.0),
    Option.of("worker", "poll_interval", positive_float, 1.0),
    Option.of("worker", "grace", positive_float),
    Option.of("worker", "reply_destination", default="default"),
    Option.of("worker", "metrics_port", non_negative_int),
    Option.of("worker", "metrics_host", default=DEFAULT_HOST),
    *log_options("worker"),
)
"""The worker's settings: each a flag, an OUTBOX_WORKER_* variable, or worker.* in the file."""

HELP = {
    "handler": "MODULE:FUNCTION, called as handler(claim, stop) for each task; "
    "an `async def` runs on one event loop",
    "concurrency": "tasks at once (default 1)",
    "owner": "lease owner (default: host and pid)",
    "lease": "seconds (default 30)",
    "poll_interval": "seconds between looks for work (default 1)",
    "grace": "SIGTERM drain in seconds (default: the lease)",
    "reply_destination": "destination of task replies (default: default)",
    "metrics_port": "serve /metrics, /healthz (liveness), /readyz on this port (0: off)",
    "metrics_host": f"address the metrics port binds (default {DEFAULT_HOST}; 0.0.0.0 for all)",
    **LOG_HELP,
}


def add_parser(commands: Any, db_argument: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `outbox worker`; defaults are filled in later (see outbox_cli.settings)."""
    parser = commands.add_parser("worker", help="run a handler over claimed tasks")
    db_argument(parser)
    add_flags(parser, OPTIONS, HELP)


def run(args: argparse.Namespace) -> int:
    """Run the worker until SIGTERM/SIGINT; 0 after a clean drain."""
    configure_logging(args.log_format, args.log_level)
    announce("worker", args.db, config_path(args))
    with TaskQueue(args.db, lease=args.lease, reply_destination=args.reply_destination) as queue:
        metrics = WorkerMetrics() if args.metrics_port else None
        worker = Worker(
            queue,
            args.handler,
            owner=args.owner,
            concurrency=args.concurrency,
            poll_interval=args.poll_interval,
            grace=args.grace,
            metrics=metrics,
        )
        server = (
            nullcontext()
            if metrics is None
            else metrics_server(
                args,
                render=metrics.render,
                health=worker.health,
                ready=worker.readiness,
            )
        )
        with server:
            try:
                tune_if_own_process()
                worker.run()
            except WrongHandlerKind as exc:
                report_error(f"outbox: error: {exc}")
                return 1
    return 0
