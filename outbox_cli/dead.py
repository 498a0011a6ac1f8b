"""`outbox dead list|show|requeue|resolve`: the messages that will not be delivered, and
decisions about them.

The decisions themselves are outbox.decisions'; their commands live in their own
modules (outbox_cli.requeue, outbox_cli.resolve); what those share, choosing dead
messages by REPLY_ID or filters and reporting, in outbox_cli.decisions.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from outbox.dead_filter import DeadFilter
from outbox.one_line import one_line
from outbox.operations import Operations
from outbox.redaction import redact
from outbox_cli import requeue, resolve
from outbox_cli.arguments import age_text, json_flag, positive_int, print_json, utc_iso
from outbox_cli.decisions import add_decision_arguments, add_filters, chosen_filter, dead_message

ERROR_WIDTH = 60


def add_parser(commands: Any, db_argument: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `outbox dead list|show|requeue|resolve`."""
    dead = commands.add_parser("dead", help="messages that will not be delivered")
    dead_commands = dead.add_subparsers(dest="dead_command", required=True)
    listing = dead_commands.add_parser("list", help="dead messages, oldest first")
    db_argument(listing)
    listing.add_argument("--limit", type=positive_int, default=100)
    add_filters(listing)
    json_flag(listing)
    show = dead_commands.add_parser("show", help="one message's last error, attempts and body")
    db_argument(show)
    show.add_argument("reply_id")
    json_flag(show)
    requeuing = dead_commands.add_parser(
        "requeue",
        help="send dead messages again (same reply_id and body), audited: one REPLY_ID, "
        "or every one the filters choose",
    )
    db_argument(requeuing)
    add_decision_arguments(requeuing, "requeued")
    requeue.add_arguments(requeuing)
    resolving = dead_commands.add_parser(
        "resolve",
        help="settle dead messages as needing no delivery (final; purge deletes them later), "
        "audited: one REPLY_ID, or every one the filters choose",
    )
    db_argument(resolving)
    add_decision_arguments(resolving, "resolved")


def run(args: argparse.Namespace) -> int:
    """Run `outbox dead ...`; returns the exit status."""
    with Operations(args.db) as ops:
        if args.dead_command == "list":
            return _dead_list(ops, args.db, args.limit, chosen_filter(args), args.json)
        if args.dead_command == "requeue":
            return requeue.run(ops, args)
        if args.dead_command == "resolve":
            return resolve.run(ops, args)
        return _dead_show(ops, args.reply_id, args.json)


def _dead_list(ops: Operations, db: str, limit: int, chosen: DeadFilter, as_json: bool) -> int:
    rows = ops.dead(limit, chosen)
    for row in rows:
        del row["id"]  # the row's key for paging, not part of what the list shows
        row["created"] = utc_iso(row["created_at"])
        row["age"] = round(float(row["age"]), 3)
    if as_json:
        print_json(rows)
        return 0
    print(f"database {redact(db)}")
    if not rows:
        print("no dead messages")
        return 0
    print(
        f"{'reply_id':<40} {'destination':<16} {'created (UTC)':<20} {'age':>6} "
        f"{'attempts':>8} {'status':>6}  last error"
    )
    for row in rows:
        error = one_line(row["last_error"] or "", ERROR_WIDTH)
        status = "" if row["last_status"] is None else str(row["last_status"])
        print(
            f"{row['reply_id']:<40} {row['destination']:<16} {row['created']:<20} "
            f"{age_text(row['age']):>6} {row['attempts']:>8} {status:>6}  {error}"
        )
    if len(rows) == limit:
        print(f"(first {limit}; --limit shows more)")
    return 0


def _dead_show(ops: Operations, reply_id: str, as_json: bool) -> int:
    message = dead_message(ops, reply_id)
    if message is None:
        return 1
    body = bytes(message.pop("body"))
    message["created"] = utc_iso(message["created_at"])
    message["sent"] = utc_iso(message["sent_at"])
    try:
        message["body"] = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        message["body"] = None  # not UTF-8 JSON: body_bytes says how long it is
    if as_json:
        print_json(message)
        return 0
    for name, value in message.items():
        if name != "body":
            print(f"{name:<13} {'' if value is None else value}")
    if message["body"] is None:
        print(f"body          ({message['body_bytes']} bytes, not UTF-8 JSON)")
    else:
        print("body")
        print(json.dumps(message["body"], indent=2, ensure_ascii=False))
    return 0
