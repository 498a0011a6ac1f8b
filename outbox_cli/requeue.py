"""`outbox dead requeue`: send dead messages again, each after asking its receipt lookup.

A requeue (of one message, or of every dead message a filter chooses) first asks
the destination's receipt lookup, refuses what the destination already holds or
cannot be asked about unless --force, and keeps an audit row per message.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

from outbox.errors import RequeueRefused
from outbox.operations import Operations
from outbox_cli.arguments import print_json
from outbox_cli.decisions import Decided, chosen_many, dead_message, decide_many, operator
from outbox_cli.relay import CONFIG_ENV as RELAY_CONFIG_ENV
from outbox_cli.settings import CONFIG_ENV
from relay.config import DESTINATION_ENV_PREFIX, Destination, load_destinations
from relay.receipts import Receipt, ask_receipt, ask_receipts

REFUSALS = {
    "received": "the destination already holds this exact message",
    "other body": "the destination holds this reply_id with another body (a conflict)",
    "unknown": "the destination's receipt lookup did not answer",
    "not checked": "nothing could be asked whether the destination holds it",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """What requeue takes besides the arguments every decision takes."""
    parser.add_argument(
        "--force",
        action="store_true",
        help="requeue even when the destination holds the message or cannot be asked",
    )


@dataclass
class Requeued(Decided):
    """What a requeue did with one message, and what its receipt lookup said."""

    receipt: str = "not checked"

    def detail(self) -> str:
        """The receipt lookup's answer."""
        return f" (receipt: {self.receipt})"


class Requeuer:
    """Requeues dead messages one at a time, each asking its receipt lookup first."""

    def __init__(self, ops: Operations, args: argparse.Namespace) -> None:
        """Reads the destinations' lookups from the relay config file and the
        OUTBOX_DESTINATION_* variables, as the relay does."""
        self.ops = ops
        self.args = args
        config = args.config or os.environ.get(CONFIG_ENV) or os.environ.get(RELAY_CONFIG_ENV)
        from_environment = any(name.startswith(DESTINATION_ENV_PREFIX) for name in os.environ)
        sources = [config] if config else []
        sources += [f"{DESTINATION_ENV_PREFIX}* variables"] if from_environment else []
        self.source = " and ".join(sources) or None
        """Where the destinations come from, for messages; None when nowhere."""
        self.destinations: dict[str, Destination] = load_destinations(config) if self.source else {}
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

    def requeue(self, message: dict[str, Any], overriding: str | None = None) -> Requeued:
        """Ask, then requeue (or say why not, or what a dry run would do). `overriding`: the
        one refusing answer forced past without --force (the console's confirmed refusal);
        any other refusing answer still refuses, as it was not what was confirmed."""
        receipt = self._answers.pop(message["reply_id"], None) or self._ask(message)
        reply_id = message["reply_id"]
        forced = self.args.force or (receipt in REFUSALS and receipt == overriding)
        if receipt in REFUSALS and not forced:
            return Requeued(reply_id, "refused", REFUSALS[receipt], receipt=receipt)
        if self.args.dry_run:
            return Requeued(reply_id, "would requeue", receipt=receipt)
        try:
            audit = self.ops.requeue(
                reply_id,
                reason=self.args.reason,
                by=operator(self.args),
                receipt=receipt,
                forced=forced,
            )
        except RequeueRefused as exc:
            return Requeued(reply_id, "refused", str(exc), receipt=receipt)
        return Requeued(reply_id, "requeued", audit=audit, receipt=receipt)

    def _ask(self, message: dict[str, Any]) -> str:
        """What the destination's receipt lookup says of this message (see RECEIPT_ANSWERS)."""
        name = message["destination"]
        destination = self.destinations.get(name)
        if destination is None or not destination.receipt_lookup:
            if self.source is not None and name not in self._unasked:
                self._unasked.add(name)  # said once per destination, however many messages
                print(
                    f"outbox: receipt not checked: {_unaskable(name, destination, self.source)}",
                    file=sys.stderr,
                )
            return "not checked"
        return _receipt_answer(
            ask_receipt(destination, message["reply_id"], message["content_hash"])
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
    requeuer = Requeuer(ops, args)
    if requeuer.source is None:
        print(
            "outbox: receipt not checked: no config file (--config) or "
            f"{DESTINATION_ENV_PREFIX}* variables name the destinations' receipt lookups",
            file=sys.stderr,
        )
    if chosen is None:
        return _requeue_one(ops, requeuer, args)
    chosen_messages = ops.dead(args.limit, chosen)
    requeuer.ask_ahead(chosen_messages)
    return decide_many(chosen_messages, requeuer.requeue, args, "requeue", "requeued")


def _requeue_one(ops: Operations, requeuer: Requeuer, args: argparse.Namespace) -> int:
    message = dead_message(ops, args.reply_id)
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
