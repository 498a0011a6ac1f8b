"""`outbox dead list|show|requeue`: the messages that will not be delivered, and decisions.

A requeue (of one message, or of every dead message a filter chooses) first asks
the destination's receipt lookup, refuses what the destination already holds or
cannot be asked about unless --force, and keeps an audit row per message.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from outbox.cli.arguments import (
    age_text,
    json_flag,
    non_empty,
    parse_duration,
    positive_int,
    print_json,
)
from outbox.cli.relay import CONFIG_ENV as RELAY_CONFIG_ENV
from outbox.cli.settings import CONFIG_ENV
from outbox.db.operations_sql import DeadFilter
from outbox.errors import RequeueRefused
from outbox.operations import Operations
from outbox.states import MessageState
from relay.config import Destination, load_destinations
from relay.receipts import Receipt, ask_receipt, ask_receipts

ERROR_WIDTH = 60
BULK_LIMIT = 10_000
REFUSALS = {
    "received": "the destination already holds this exact message",
    "other body": "the destination holds this reply_id with another body (a conflict)",
    "unknown": "the destination's receipt lookup did not answer",
    "not checked": "nothing could be asked whether the destination holds it",
}


def add_parser(commands: Any, db_argument: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `outbox dead list|show|requeue`."""
    dead = commands.add_parser("dead", help="messages that will not be delivered")
    dead_commands = dead.add_subparsers(dest="dead_command", required=True)
    listing = dead_commands.add_parser("list", help="dead messages, oldest first")
    db_argument(listing)
    listing.add_argument("--limit", type=positive_int, default=100)
    _filters(listing)
    json_flag(listing)
    show = dead_commands.add_parser("show", help="one message's last error, attempts and body")
    db_argument(show)
    show.add_argument("reply_id")
    json_flag(show)
    requeue = dead_commands.add_parser(
        "requeue",
        help="send dead messages again (same reply_id and body), audited: one REPLY_ID, "
        "or every one the filters choose",
    )
    db_argument(requeue)
    requeue.add_argument("reply_id", nargs="?")
    _filters(requeue)
    requeue.add_argument("--reason", required=True, type=non_empty, help="kept in the audit")
    requeue.add_argument(
        "--by", type=non_empty, default=None, help="who decides (default: the login name)"
    )
    requeue.add_argument(
        "--force",
        action="store_true",
        help="requeue even when the destination holds the message or cannot be asked",
    )
    requeue.add_argument(
        "--dry-run", action="store_true", help="list what would be requeued; change nothing"
    )
    requeue.add_argument(
        "--limit",
        type=positive_int,
        default=BULK_LIMIT,
        help=f"at most this many with filters (default {BULK_LIMIT})",
    )
    json_flag(requeue)


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--destination", type=non_empty, help="only this destination's messages")
    parser.add_argument("--status", type=positive_int, help="only this last HTTP status")
    parser.add_argument(
        "--error", type=non_empty, help="only where the last error contains this text"
    )
    parser.add_argument(
        "--since", type=parse_duration, metavar="DURATION", help="created within, e.g. 2h"
    )
    parser.add_argument(
        "--until", type=parse_duration, metavar="DURATION", help="created at least this long ago"
    )


def _chosen(args: argparse.Namespace) -> DeadFilter:
    return DeadFilter(
        destination=args.destination,
        status=args.status,
        error=args.error,
        newer_than=args.since,
        older_than=args.until,
    )


def run(args: argparse.Namespace) -> int:
    """Run `outbox dead ...`; returns the exit status."""
    with Operations(args.db) as ops:
        if args.dead_command == "list":
            return _dead_list(ops, args.limit, _chosen(args), args.json)
        if args.dead_command == "requeue":
            return _dead_requeue(ops, args)
        return _dead_show(ops, args.reply_id, args.json)


def _iso(epoch: float | None) -> str | None:
    """Epoch seconds as ISO-8601 in UTC."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _dead_list(ops: Operations, limit: int, chosen: DeadFilter, as_json: bool) -> int:
    rows = ops.dead(limit, chosen)
    for row in rows:
        row["created"] = _iso(row["created_at"])
        row["age"] = round(float(row["age"]), 3)
    if as_json:
        print_json(rows)
        return 0
    if not rows:
        print("no dead messages")
        return 0
    print(
        f"{'reply_id':<40} {'destination':<16} {'created (UTC)':<20} {'age':>6} "
        f"{'attempts':>8} {'status':>6}  last error"
    )
    for row in rows:
        error = (row["last_error"] or "").replace("\n", " ")
        if len(error) > ERROR_WIDTH:
            error = error[: ERROR_WIDTH - 1] + "…"
        status = "" if row["last_status"] is None else str(row["last_status"])
        print(
            f"{row['reply_id']:<40} {row['destination']:<16} {row['created']:<20} "
            f"{age_text(row['age']):>6} {row['attempts']:>8} {status:>6}  {error}"
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
    body = bytes(message.pop("body"))
    message["created"] = _iso(message["created_at"])
    message["sent"] = _iso(message["sent_at"])
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


@dataclass
class Requeued:
    """What a requeue did with one message."""

    reply_id: str
    receipt: str
    outcome: str  # requeued, would requeue, refused
    why: str | None = None
    audit: dict[str, Any] | None = None


class Requeuer:
    """Requeues dead messages one at a time, each asking its receipt lookup first."""

    def __init__(self, ops: Operations, args: argparse.Namespace) -> None:
        """Reads the destinations' lookups from the relay config, when one is named."""
        self.ops = ops
        self.args = args
        self.config = args.config or os.environ.get(CONFIG_ENV) or os.environ.get(RELAY_CONFIG_ENV)
        self.destinations: dict[str, Destination] = (
            {} if self.config is None else load_destinations(self.config)
        )
        self._unasked: set[str] = set()
        self._answers: dict[str, str] = {}

    def ask_ahead(self, chosen: list[dict[str, Any]]) -> None:
        """Ask every chosen message's receipt lookup now, many at a time per destination."""
        by_destination: dict[str, list[dict[str, Any]]] = {}
        for message in chosen:
            by_destination.setdefault(message["destination"], []).append(message)
        for name, group in by_destination.items():
            destination = self.destinations.get(name)
            if destination is None or not destination.receipt_lookup:
                continue
            pairs = [(m["reply_id"], m["content_hash"]) for m in group]
            for message, answer in zip(group, ask_receipts(destination, pairs), strict=True):
                self._answers[message["reply_id"]] = _receipt_answer(answer)

    def requeue(self, message: dict[str, Any]) -> Requeued:
        """Ask, then requeue (or say why not, or what a dry run would do)."""
        receipt = self._answers.pop(message["reply_id"], None) or self._ask(message)
        reply_id = message["reply_id"]
        if receipt in REFUSALS and not self.args.force:
            return Requeued(reply_id, receipt, "refused", REFUSALS[receipt])
        if self.args.dry_run:
            return Requeued(reply_id, receipt, "would requeue")
        try:
            audit = self.ops.requeue(
                reply_id,
                reason=self.args.reason,
                by=self.args.by or getpass.getuser(),
                receipt=receipt,
                forced=self.args.force,
            )
        except RequeueRefused as exc:
            return Requeued(reply_id, receipt, "refused", str(exc))
        return Requeued(reply_id, receipt, "requeued", audit=audit)

    def _ask(self, message: dict[str, Any]) -> str:
        """What the destination's receipt lookup says of this message (see RECEIPT_ANSWERS)."""
        name = message["destination"]
        destination = self.destinations.get(name)
        if destination is None or not destination.receipt_lookup:
            if self.config is not None and name not in self._unasked:
                self._unasked.add(name)  # said once per destination, however many messages
                print(
                    f"outbox: receipt not checked: destination {name!r} has no receipt "
                    f"lookup in {self.config}",
                    file=sys.stderr,
                )
            return "not checked"
        return _receipt_answer(
            ask_receipt(destination, message["reply_id"], message["content_hash"])
        )


def _receipt_answer(answer: Receipt | None) -> str:
    """The audit's word for a receipt lookup's answer (see RECEIPT_ANSWERS)."""
    if answer is None:
        return "unknown"
    return {"held": "received", "other body": "other body", "absent": "not received"}[answer]


def _dead_requeue(ops: Operations, args: argparse.Namespace) -> int:
    chosen = _chosen(args)
    if args.reply_id is not None and chosen != DeadFilter():
        raise ValueError("give a REPLY_ID or filters, not both")
    requeuer = Requeuer(ops, args)
    if requeuer.config is None:
        print(
            "outbox: receipt not checked: no config file (--config) names the "
            "destinations' receipt lookups",
            file=sys.stderr,
        )
    if args.reply_id is not None:
        return _requeue_one(ops, requeuer, args)
    if chosen == DeadFilter():
        raise ValueError(
            "requeue needs a REPLY_ID or at least one filter "
            "(--destination, --status, --error, --since, --until)"
        )
    return _requeue_many(ops, requeuer, chosen, args)


def _requeue_one(ops: Operations, requeuer: Requeuer, args: argparse.Namespace) -> int:
    message = _dead_message(ops, args.reply_id)
    if message is None:
        return 1
    done = requeuer.requeue(message)
    if done.outcome == "refused":
        hint = "; --force to send it anyway" if done.receipt in REFUSALS else ""
        print(f"outbox: not requeued: {done.why}{hint}", file=sys.stderr)
        return 1
    if args.json:
        print_json(done.audit if done.audit is not None else vars(done))
    elif done.audit is None:
        print(f"would requeue {args.reply_id!r} (receipt: {done.receipt})")
    else:
        print(
            f"requeued {args.reply_id!r} with a fresh budget (audit #{done.audit['id']}, "
            f"receipt: {done.receipt})"
        )
    return 0


def _requeue_many(
    ops: Operations, requeuer: Requeuer, chosen: DeadFilter, args: argparse.Namespace
) -> int:
    chosen_messages = ops.dead(args.limit, chosen)
    requeuer.ask_ahead(chosen_messages)
    results: list[Requeued] = []
    progress = sys.stderr.isatty() and not args.json
    for index, message in enumerate(chosen_messages, start=1):
        results.append(requeuer.requeue(message))
        if progress:
            print(f"\r{index}/{len(chosen_messages)}", end="", file=sys.stderr, flush=True)
    if progress and chosen_messages:
        print(file=sys.stderr)
    refused = [r for r in results if r.outcome == "refused"]
    if args.json:
        print_json([vars(r) for r in results])
    else:
        for result in results:
            why = f": {result.why}" if result.why else ""
            print(f"{result.outcome:<13} {result.reply_id} (receipt: {result.receipt}){why}")
        verb = "would requeue" if args.dry_run else "requeued"
        print(f"{verb} {len(results) - len(refused)}, refused {len(refused)}")
        if len(chosen_messages) == args.limit:
            print(f"(first {args.limit}; --limit chooses more)")
    return 1 if refused else 0
