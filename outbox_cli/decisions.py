"""What the decisions on dead messages share on the command line: choosing them, and
reporting what was done.

An operator decides about one REPLY_ID, or about every dead message the `dead list`
filters choose; each message gets its own audited decision (outbox.decisions, which
the console takes too), and a bulk run reports one line per message and exits 1 when
any was refused.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Sequence
from typing import Any

from outbox import decisions
from outbox.dead_filter import DeadFilter
from outbox.decisions import BULK_LIMIT, Decision, Progress, RequeueDecision
from outbox.errors import NotDead
from outbox.operations import Operations
from outbox.states import MessageState
from outbox_cli.arguments import json_flag, non_empty, parse_duration, positive_int, print_json


def add_filters(parser: argparse.ArgumentParser) -> None:
    """The `dead list` filters: destination, last status, error text, creation time."""
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


def chosen_filter(args: argparse.Namespace) -> DeadFilter:
    """The filter the command line's --destination/--status/--error/--since/--until name."""
    return DeadFilter(
        destination=args.destination,
        status=args.status,
        error=args.error,
        newer_than=args.since,
        older_than=args.until,
    )


def add_decision_arguments(parser: argparse.ArgumentParser, done: str) -> None:
    """REPLY_ID or filters, --reason, --by, --dry-run, --limit and --json for a decision."""
    parser.add_argument("reply_id", nargs="?")
    add_filters(parser)
    parser.add_argument("--reason", required=True, type=non_empty, help="kept in the audit")
    parser.add_argument(
        "--by", type=non_empty, default=None, help="who decides (default: the login name)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help=f"list what would be {done}; change nothing"
    )
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=BULK_LIMIT,
        help=f"at most this many with filters (default {BULK_LIMIT})",
    )
    json_flag(parser)


def operator(args: argparse.Namespace) -> str:
    """Who decides: --by, or the login name; a dry run, which decides nothing, needs neither."""
    if args.by:
        return str(args.by)
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name (a container's uid without a passwd entry)
        if getattr(args, "dry_run", False):
            return "(dry run)"
        raise ValueError("no login name to keep in the audit: give --by NAME") from None


def chosen_many(args: argparse.Namespace, verb: str) -> DeadFilter | None:
    """The filter a bulk decision runs on, or None for the one REPLY_ID given."""
    chosen = chosen_filter(args)
    if args.reply_id is not None and chosen != DeadFilter():
        raise ValueError("give a REPLY_ID or filters, not both")
    if args.reply_id is not None:
        return None
    if chosen == DeadFilter():
        raise ValueError(
            f"{verb} needs a REPLY_ID or at least one filter "
            "(--destination, --status, --error, --since, --until)"
        )
    return chosen


def say_not_dead(exc: NotDead) -> None:
    """Say on stderr why a REPLY_ID names no dead message."""
    if exc.state is None:
        found = "no message"
    elif exc.state == MessageState.RESOLVED:
        found = "message is resolved, which is final (it needs no delivery):"
    else:
        found = f"message is {exc.state}, not dead:"
    print(f"outbox: {found} {exc.reply_id!r}", file=sys.stderr)


def dead_message(ops: Operations, reply_id: str) -> dict[str, Any] | None:
    """The dead message, or None after saying on stderr why there is none."""
    try:
        return decisions.dead_message(ops, reply_id)
    except NotDead as exc:
        say_not_dead(exc)
        return None


def progress(args: argparse.Namespace) -> Progress | None:
    """A bulk run's counter on a terminal's stderr (none under --json or off a terminal)."""
    if not sys.stderr.isatty() or args.json:
        return None

    def show(done: int, chosen: int) -> None:
        print(f"\r{done}/{chosen}", end="", file=sys.stderr, flush=True)
        if done == chosen:
            print(file=sys.stderr)

    return show


def line(decided: Decision) -> str:
    """One line of a bulk run's report; a requeue's says what its receipt lookup answered."""
    detail = f" (receipt: {decided.receipt})" if isinstance(decided, RequeueDecision) else ""
    why = f": {decided.why}" if decided.why else ""
    return f"{decided.outcome:<13} {decided.reply_id}{detail}{why}"


def report_many(results: Sequence[Decision], args: argparse.Namespace, verb: str, done: str) -> int:
    """Report a bulk run's decisions; exit status 1 when any was refused."""
    refused = [r for r in results if r.outcome == "refused"]
    if args.json:
        print_json([vars(r) for r in results])
    else:
        for result in results:
            print(line(result))
        counted = f"would {verb}" if args.dry_run else done
        print(f"{counted} {len(results) - len(refused)}, refused {len(refused)}")
        if len(results) == args.limit:
            print(f"(first {args.limit}; --limit chooses more)")
    return 1 if refused else 0
