"""`outbox receiver dead list|show|retry|purge`: the messages a broker consumer gave up on.

`outbox receiver consume` keeps a message whose effect raised on each of
``--max-deliveries`` deliveries in ``receiver_dead_letters`` and acknowledges it. These
commands read that table, apply a dead letter again through the reference effect
(`retry`, the effect `consume` runs; an application with its own effect calls
``ReceiptStore.retry_dead(reply_id, effect)``), or forget dead letters (`purge`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from outbox.durations import duration_text
from outbox.one_line import one_line
from outbox.redaction import redact
from outbox_cli.arguments import json_flag, parse_duration, positive_int, print_json, utc_iso

if TYPE_CHECKING:
    from receiver.store import ReceiptStore

REASON_WIDTH = 60


def add_parser(actions: Any, db_argument: Callable[[argparse.ArgumentParser, Any], None]) -> None:
    """Register `dead list|show|retry|purge` on the receiver's actions."""
    dead = actions.add_parser(
        "dead", help="messages a broker consumer gave up on (their effect kept raising)"
    )
    commands = dead.add_subparsers(dest="dead_command", required=True)
    listing = commands.add_parser("list", help="dead letters, oldest first")
    db_argument(listing, argparse.SUPPRESS)
    listing.add_argument("--limit", type=positive_int, default=100)
    json_flag(listing)
    show = commands.add_parser("show", help="one dead letter: reason, deliveries, headers, body")
    db_argument(show, argparse.SUPPRESS)
    show.add_argument("reply_id")
    json_flag(show)
    retrying = commands.add_parser(
        "retry",
        help="apply a dead letter's body through the reference effect (the one `consume` "
        "runs) as its first receipt, and forget it",
    )
    db_argument(retrying, argparse.SUPPRESS)
    retrying.add_argument("reply_id")
    purge = commands.add_parser("purge", help="forget one dead letter, or the old ones")
    db_argument(purge, argparse.SUPPRESS)
    chosen = purge.add_mutually_exclusive_group(required=True)
    chosen.add_argument("reply_id", nargs="?", help="the dead letter to forget")
    chosen.add_argument(
        "--older-than", type=parse_duration, help="forget those dead for longer, e.g. 30d"
    )


def run(args: argparse.Namespace) -> int:
    """Run `outbox receiver dead ...`; returns the exit status."""
    from receiver.store import ReceiptStore

    with ReceiptStore(args.db) as store:
        if args.dead_command == "list":
            return _list(store, args.db, args.limit, args.json)
        if args.dead_command == "show":
            return _show(store, args.reply_id, args.json)
        if args.dead_command == "retry":
            return _retry(store, args.reply_id)
        return _purge(store, args.reply_id, args.older_than)


def _list(store: ReceiptStore, db: str, limit: int, as_json: bool) -> int:
    rows = store.dead_letters(limit)
    for row in rows:
        row["dead"] = utc_iso(row.pop("dead_at"))
    if as_json:
        print_json(rows)
        return 0
    print(f"database {redact(db)}")
    if not rows:
        print("no dead letters")
        return 0
    print(f"{'reply_id':<40} {'dead (UTC)':<20} {'failures':>8} {'deliveries':>10}  reason")
    for row in rows:
        reason = one_line(row["reason"], REASON_WIDTH)
        deliveries = "" if row["deliveries"] is None else str(row["deliveries"])
        print(
            f"{row['reply_id']:<40} {row['dead']:<20} {row['failures']:>8} {deliveries:>10}  "
            f"{reason}"
        )
    if len(rows) == limit:
        print(f"(first {limit}; --limit shows more)")
    return 0


def _show(store: ReceiptStore, reply_id: str, as_json: bool) -> int:
    letter = store.dead_letter(reply_id)
    if letter is None:
        print(f"no dead letter {reply_id!r}")
        return 1
    body: bytes = letter.pop("body")
    letter["dead"] = utc_iso(letter.pop("dead_at"))
    letter["body_bytes"] = len(body)
    try:
        letter["body"] = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        letter["body"] = None  # not UTF-8 JSON: body_bytes says how long it is
    if as_json:
        print_json(letter)
        return 0
    for name, value in letter.items():
        if name not in ("body", "headers"):
            print(f"{name:<13} {'' if value is None else value}")
    print("headers")
    for name, value in letter["headers"].items():
        print(f"  {name}: {value}")
    if letter["body"] is None:
        print(f"body          ({letter['body_bytes']} bytes, not UTF-8 JSON)")
    else:
        print("body")
        print(json.dumps(letter["body"], indent=2, ensure_ascii=False))
    return 0


def _retry(store: ReceiptStore, reply_id: str) -> int:
    from receiver.effects import record_effect

    status = store.retry_dead(reply_id, record_effect)
    if status is None:
        print(f"no dead letter {reply_id!r}")
        return 1
    if status == "conflict":
        print(f"{reply_id} is held with another body: nothing applied, the dead letter stays")
        return 1
    said = "applied" if status == "stored" else "was applied already (a duplicate)"
    print(f"{reply_id} {said}; its dead letter is gone")
    return 0


def _purge(store: ReceiptStore, reply_id: str | None, older_than: float | None) -> int:
    removed = store.purge_dead(reply_id, older_than=older_than)
    if reply_id is not None:
        print(f"forgot the dead letter {reply_id}" if removed else f"no dead letter {reply_id!r}")
        return 0 if removed else 1
    assert older_than is not None
    print(f"forgot {removed} dead letter(s) older than {duration_text(older_than)}")
    return 0
