"""`outbox task cancel`: an operator cancels a pending or running task, audited.

The task's state becomes cancelled and its one reply (code "cancelled", the reason its
message) is written, as a worker's would be, to the worker's reply destination
([worker] reply_destination, or --reply-destination); who and why are kept in
outbox_task_decisions. The decision is Operations.cancel_task's, which the console's
cancel also takes; here, the report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from outbox.errors import TaskNotCancelled
from outbox.operations import Operations
from outbox_cli.arguments import json_flag, non_empty, print_json
from outbox_cli.decisions import operator
from outbox_cli.settings import Option, add_flags

OPTIONS = (Option.of("worker", "reply_destination", default="default"),)
HELP = {"reply_destination": "where the task's reply goes, as the worker's (default: default)"}


def add_parser(commands: Any, db_argument: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `outbox task cancel`."""
    task = commands.add_parser("task", help="decisions about tasks")
    task_commands = task.add_subparsers(dest="task_command", required=True)
    cancelling = task_commands.add_parser(
        "cancel",
        help="cancel a pending or running task, its reply written as a worker's, audited",
    )
    db_argument(cancelling)
    cancelling.add_argument("task_id")
    cancelling.add_argument("--reason", required=True, type=non_empty, help="kept in the audit")
    cancelling.add_argument(
        "--by", type=non_empty, default=None, help="who decides (default: the login name)"
    )
    add_flags(cancelling, OPTIONS, HELP)
    json_flag(cancelling)


def run(args: argparse.Namespace) -> int:
    """Run `outbox task cancel`; returns the exit status."""
    with Operations(args.db) as ops:
        try:
            audit = ops.cancel_task(
                args.task_id,
                reason=args.reason,
                by=operator(args),
                reply_destination=args.reply_destination,
            )
        except TaskNotCancelled as exc:
            print(f"outbox: not cancelled: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print_json(audit)
    else:
        print(
            f"cancelled {args.task_id!r}: its reply goes to {args.reply_destination!r} "
            f"(audit #{audit['id']})"
        )
    return 0
