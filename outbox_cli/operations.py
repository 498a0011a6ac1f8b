"""`outbox status` and `outbox purge`: readable, or JSON (--json)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from outbox.operations import PURGE_BATCH, Operations
from outbox.redaction import redact
from outbox_cli.arguments import age_text, json_flag, parse_duration, positive_int, print_json

ERROR_WIDTH = 60


def add_parsers(commands: Any, db_argument: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register status and purge."""
    status = commands.add_parser("status", help="tasks and messages per state, oldest pending")
    db_argument(status)
    json_flag(status)

    purge = commands.add_parser(
        "purge", help="delete messages sent or resolved long ago, in batches"
    )
    db_argument(purge)
    # --sent-older-than is the name from before resolved messages, kept for existing jobs.
    purge.add_argument(
        "--older-than",
        "--sent-older-than",
        dest="older_than",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="sent or resolved at least this long ago, e.g. 30d, 12h, 90m",
    )
    purge.add_argument("--batch", type=positive_int, default=PURGE_BATCH)
    json_flag(purge)


def run(args: argparse.Namespace) -> int:
    """Run status or purge; returns the exit status."""
    with Operations(args.db) as ops:
        if args.command == "status":
            return _status(ops, args.db, args.json)
        return _purge(ops, args.older_than, args.batch, args.json)


def _status(ops: Operations, db: str, as_json: bool) -> int:
    status = ops.status()
    if as_json:
        print_json(status)
        return 0
    print(f"database {redact(db)}")
    for kind in ("tasks", "messages"):
        counts = "  ".join(f"{state} {count}" for state, count in status[kind].items())
        print(f"{kind:<8} {counts}")
    print(f"oldest pending task:    {age_text(status['oldest_pending_task_age'])}")
    print(f"oldest pending message: {age_text(status['oldest_pending_message_age'])}")
    if status["unrouted"]:
        print(
            f"{status['unrouted']} unrouted (oldest {age_text(status['oldest_unrouted_age'])}): "
            "pending for a destination no running relay delivers"
        )
    if status["dead"]:
        print(f"{status['dead']} dead: see `outbox dead list`")
    return 0


def _purge(ops: Operations, older_than: float, batch: int, as_json: bool) -> int:
    def progress(removed: int) -> None:
        print(f"\rpurged {removed}", end="", file=sys.stderr, flush=True)

    removed = ops.purge(older_than, batch, progress if sys.stderr.isatty() else None)
    total = sum(removed.values())
    if sys.stderr.isatty() and total:
        print(file=sys.stderr)
    if as_json:
        print_json({"purged": total, "by_state": removed, "older_than_seconds": older_than})
    else:
        each = ", ".join(f"{count} {state}" for state, count in removed.items())
        print(
            f"purged {total} messages sent or resolved more than {age_text(older_than)} ago "
            f"({each})"
        )
    return 0
