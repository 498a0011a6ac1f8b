"""`outbox dead requeue`: send dead messages again, each after asking its receipt lookup.

A requeue (of one message, or of every dead message a filter chooses) first asks
the destination's receipt lookup, refuses what the destination already holds or
cannot be asked about unless --force, and keeps an audit row per message
(outbox.decisions). Here: the lookups the relay's configuration names, and the report.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from outbox import decisions
from outbox.decisions import REFUSALS
from outbox.errors import NotDead
from outbox.operations import Operations
from outbox_cli.arguments import print_json
from outbox_cli.decisions import chosen_many, operator, progress, report_many, say_not_dead
from outbox_cli.relay import CONFIG_ENV as RELAY_CONFIG_ENV
from outbox_cli.settings import CONFIG_ENV
from relay.config import DESTINATION_ENV_PREFIX, Destination, load_destinations
from relay.receipts import Receipt, ask_receipts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """What requeue takes besides the arguments every decision takes."""
    parser.add_argument(
        "--force",
        action="store_true",
        help="requeue even when the destination holds the message or cannot be asked",
    )


class DestinationLookups:
    """The destinations' receipt lookups, as the relay reads them (its config file and the
    OUTBOX_DESTINATION_* variables): the outbox.decisions.ReceiptLookup of both front ends."""

    def __init__(self, config: str | None) -> None:
        """Read the destinations from `config`, else the command's or the relay's config
        file variable, and the OUTBOX_DESTINATION_* variables."""
        config = config or os.environ.get(CONFIG_ENV) or os.environ.get(RELAY_CONFIG_ENV)
        from_environment = any(name.startswith(DESTINATION_ENV_PREFIX) for name in os.environ)
        sources = [config] if config else []
        sources += [f"{DESTINATION_ENV_PREFIX}* variables"] if from_environment else []
        self.source = " and ".join(sources) or None
        """Where the destinations come from, for messages; None when nowhere."""
        self.destinations: dict[str, Destination] = load_destinations(config) if self.source else {}
        self._unasked: set[str] = set()

    def __call__(self, messages: Sequence[Mapping[str, Any]]) -> list[str]:
        """Each message's answer (see RECEIPT_ANSWERS), asked many at a time per destination;
        a destination that cannot be asked is said on stderr, once."""
        answers: dict[int, str] = {}
        by_destination: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            by_destination.setdefault(message["destination"], []).append(index)
        for name, indexes in by_destination.items():
            destination = self.destinations.get(name)
            if destination is None or not destination.receipt_lookup:
                self._say_unasked(name, destination)
                answers.update(dict.fromkeys(indexes, "not checked"))
                continue
            pairs = [(messages[i]["reply_id"], messages[i]["content_hash"]) for i in indexes]
            for index, answer in zip(indexes, ask_receipts(destination, pairs), strict=True):
                answers[index] = _receipt_answer(answer)
        return [answers[index] for index in range(len(messages))]

    def _say_unasked(self, name: str, destination: Destination | None) -> None:
        """Say once per destination why its receipts cannot be asked (when any are named)."""
        if self.source is not None and name not in self._unasked:
            self._unasked.add(name)
            print(
                f"outbox: receipt not checked: {_unaskable(name, destination, self.source)}",
                file=sys.stderr,
            )


def _unaskable(name: str, destination: Destination | None, source: str) -> str:
    """Why a destination's receipt cannot be asked, for the operator."""
    if destination is not None and destination.kind == "rabbitmq":
        # No AMQP operation finds a message in a queue by its id without consuming it.
        return f"destination {name!r} is a RabbitMQ exchange: a queue cannot be asked for a message"
    return f"destination {name!r} has no receipt lookup in {source}"


def _receipt_answer(answer: Receipt | None) -> str:
    """The audit's word for a receipt lookup's answer (see RECEIPT_ANSWERS)."""
    if answer is None:
        return "unknown"
    return {"held": "received", "other body": "other body", "absent": "not received"}[answer]


def run(ops: Operations, args: argparse.Namespace) -> int:
    """Run `outbox dead requeue`; returns the exit status."""
    chosen = chosen_many(args, "requeue")
    lookups = DestinationLookups(args.config)
    if lookups.source is None:
        print(
            "outbox: receipt not checked: no config file (--config) or "
            f"{DESTINATION_ENV_PREFIX}* variables name the destinations' receipt lookups",
            file=sys.stderr,
        )
    try:
        done = decisions.requeue(
            ops,
            args.reply_id if chosen is None else chosen,
            reason=args.reason,
            by=operator(args),
            lookup=lookups,
            force=args.force,
            dry_run=args.dry_run,
            limit=args.limit,
            progress=progress(args),
        )
    except NotDead as exc:
        say_not_dead(exc)
        return 1
    if chosen is not None:
        return report_many(done, args, "requeue", "requeued")
    [one] = done
    if one.outcome == "refused":
        hint = "; --force to send it anyway" if one.receipt in REFUSALS else ""
        print(f"outbox: not requeued: {one.why}{hint}", file=sys.stderr)
        return 1
    if args.json:
        print_json(one.audit if one.audit is not None else vars(one))
    elif one.audit is None:
        print(f"would requeue {args.reply_id!r} (receipt: {one.receipt})")
    else:
        print(
            f"requeued {args.reply_id!r} with a fresh budget (audit #{one.audit['id']}, "
            f"receipt: {one.receipt})"
        )
    return 0
