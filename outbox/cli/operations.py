"""`outbox status`, `outbox dead list|show|requeue`, `outbox purge`: readable, or JSON (--json)."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from outbox.cli.arguments import non_empty, parse_duration, positive_int
from outbox.cli.relay import CONFIG_ENV as RELAY_CONFIG_ENV
from outbox.cli.settings import CONFIG_ENV
from outbox.errors import RequeueRefused
from outbox.operations import PURGE_BATCH, Operations
from outbox.states import MessageState
from relay.config import load_destinations
from relay.receipts import ask_receipt

ERROR_WIDTH = 60


def add_parsers(commands: Any, db_argument: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register status, dead and purge."""
    status = commands.add_parser("status", help="tasks and messages per state, oldest pending")
    db_argument(status)
    _json_flag(status)

    dead = commands.add_parser("dead", help="messages that will not be delivered")
    dead_commands = dead.add_subparsers(dest="dead_command", required=True)
    listing = dead_commands.add_parser("list", help="dead messages, oldest first")
    db_argument(listing)
    listing.add_argument("--limit", type=positive_int, default=100)
    _json_flag(listing)
    show = dead_commands.add_parser("show", help="one message's last error, status and attempts")
    db_argument(show)
    show.add_argument("reply_id")
    _json_flag(show)
    requeue = dead_commands.add_parser(
        "requeue", help="send a dead message again (same reply_id and body), audited"
    )
    db_argument(requeue)
    requeue.add_argument("reply_id")
    requeue.add_argument("--reason", required=True, type=non_empty, help="kept in the audit")
    requeue.add_argument(
        "--by", type=non_empty, default=None, help="who decides (default: the login name)"
    )
    requeue.add_argument(
        "--force",
        action="store_true",
        help="requeue even when the destination holds the message or cannot be asked",
    )
    _json_flag(requeue)

    purge = commands.add_parser("purge", help="delete messages sent long ago, in batches")
    db_argument(purge)
    purge.add_argument(
        "--sent-older-than",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="e.g. 30d, 12h, 90m",
    )
    purge.add_argument("--batch", type=positive_int, default=PURGE_BATCH)
    _json_flag(purge)


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    """Run status, dead or purge; returns the exit status."""
    with Operations(args.db) as ops:
        if args.command == "status":
            return _status(ops, args.json)
        if args.command == "purge":
            return _purge(ops, args.sent_older_than, args.batch, args.json)
        if args.dead_command == "list":
            return _dead_list(ops, args.limit, args.json)
        if args.dead_command == "requeue":
            return _dead_requeue(ops, args)
        return _dead_show(ops, args.reply_id, args.json)


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, sort_keys=True))


def _status(ops: Operations, as_json: bool) -> int:
    status = ops.status()
    if as_json:
        _print_json(status)
        return 0
    for kind in ("tasks", "messages"):
        counts = "  ".join(f"{state} {count}" for state, count in status[kind].items())
        print(f"{kind:<8} {counts}")
    print(f"oldest pending task:    {_age(status['oldest_pending_task_age'])}")
    print(f"oldest pending message: {_age(status['oldest_pending_message_age'])}")
    if status["dead"]:
        print(f"{status['dead']} dead: see `outbox dead list`")
    return 0


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _dead_list(ops: Operations, limit: int, as_json: bool) -> int:
    rows = ops.dead(limit)
    if as_json:
        _print_json(rows)
        return 0
    if not rows:
        print("no dead messages")
        return 0
    print(f"{'reply_id':<40} {'destination':<16} {'attempts':>8} {'status':>6}  last error")
    for row in rows:
        error = (row["last_error"] or "").replace("\n", " ")
        if len(error) > ERROR_WIDTH:
            error = error[: ERROR_WIDTH - 1] + "…"
        status = "" if row["last_status"] is None else str(row["last_status"])
        print(
            f"{row['reply_id']:<40} {row['destination']:<16} {row['attempts']:>8} "
            f"{status:>6}  {error}"
        )
    if len(rows) == limit:
        print(f"(first {limit}; --limit shows more)")
    return 0


def _dead_message(ops: Operations, reply_id: str) -> dict[str, Any] | None:
    """The dead message, or None after saying on stderr why there is none."""
    message = ops.message(reply_id)
    if message is None or message["state"] != MessageState.DEAD:
        found = "no message" if message is None else f"message is {message['state']}, not dead:"
        print(f"outbox: {found} {reply_id!r}", file=sys.stderr)
        return None
    return message


def _dead_show(ops: Operations, reply_id: str, as_json: bool) -> int:
    message = _dead_message(ops, reply_id)
    if message is None:
        return 1
    if as_json:
        _print_json(message)
        return 0
    for name, value in message.items():
        print(f"{name:<13} {'' if value is None else value}")
    return 0


def _dead_requeue(ops: Operations, args: argparse.Namespace) -> int:
    message = _dead_message(ops, args.reply_id)
    if message is None:
        return 1
    config = args.config or os.environ.get(CONFIG_ENV) or os.environ.get(RELAY_CONFIG_ENV)
    receipt = _ask_receipt(config, message)
    refusals = {
        "received": "the destination already holds this exact message",
        "other body": "the destination holds this reply_id with another body (a conflict)",
        "unknown": "the destination's receipt lookup did not answer",
        "not checked": "nothing could be asked whether the destination holds it",
    }
    if receipt in refusals and not args.force:
        why = refusals[receipt]
        print(f"outbox: not requeued: {why}; --force to send it anyway", file=sys.stderr)
        return 1
    try:
        audit = ops.requeue(
            args.reply_id,
            reason=args.reason,
            by=args.by or getpass.getuser(),
            receipt=receipt,
            forced=args.force,
        )
    except RequeueRefused as exc:
        print(f"outbox: {exc}", file=sys.stderr)
        return 1
    if args.json:
        _print_json(audit)
    else:
        print(
            f"requeued {args.reply_id!r} with a fresh budget (audit #{audit['id']}, "
            f"receipt: {receipt})"
        )
    return 0


def _ask_receipt(config: str | None, message: dict[str, Any]) -> str:
    """What the destination's receipt lookup says of this message (see RECEIPT_ANSWERS)."""
    if config is None:
        print(
            "outbox: receipt not checked: no config file (--config) names the "
            "destination's receipt lookup",
            file=sys.stderr,
        )
        return "not checked"
    destinations = load_destinations(config)
    destination = destinations.get(message["destination"])
    if destination is None or not destination.receipt_lookup:
        print(
            f"outbox: receipt not checked: destination {message['destination']!r} has no "
            f"receipt lookup in {config}",
            file=sys.stderr,
        )
        return "not checked"
    answer = ask_receipt(destination, message["reply_id"], message["content_hash"])
    if answer is None:
        return "unknown"
    return {"held": "received", "other body": "other body", "absent": "not received"}[answer]


def _purge(ops: Operations, older_than: float, batch: int, as_json: bool) -> int:
    def progress(removed: int) -> None:
        print(f"\rpurged {removed}", end="", file=sys.stderr, flush=True)

    removed = ops.purge_sent(older_than, batch, progress if sys.stderr.isatty() else None)
    if sys.stderr.isatty() and removed:
        print(file=sys.stderr)
    if as_json:
        _print_json({"purged": removed, "sent_older_than_seconds": older_than})
    else:
        print(f"purged {removed} sent messages older than {_age(older_than)}")
    return 0
