"""`outbox dead resolve`: settle dead messages as needing no delivery, for good, audited.

The operator vouches that a dead message needs no delivery (the destination
confirmed it some other way, or it no longer matters), so nothing is asked of
the destination. A resolved message is final: never delivered, never requeued,
and `outbox purge` deletes it once old enough, as it does sent ones.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from outbox.errors import ResolveRefused
from outbox.operations import Operations
from outbox_cli.arguments import print_json
from outbox_cli.decisions import Decided, chosen_many, dead_message, decide_many, operator


def run(ops: Operations, args: argparse.Namespace) -> int:
    """Run `outbox dead resolve`; returns the exit status."""
    chosen = chosen_many(args, "resolve")
    if chosen is not None:

        def decide(message: dict[str, Any]) -> Decided:
            return _resolve(ops, args, message["reply_id"])

        return decide_many(ops.dead(args.limit, chosen), decide, args, "resolve", "resolved")
    if dead_message(ops, args.reply_id) is None:
        return 1
    done = _resolve(ops, args, args.reply_id)
    if done.outcome == "refused":
        print(f"outbox: not resolved: {done.why}", file=sys.stderr)
        return 1
    if args.json:
        print_json(done.audit if done.audit is not None else vars(done))
    elif done.audit is None:
        print(f"would resolve {args.reply_id!r}")
    else:
        print(f"resolved {args.reply_id!r}: it will not be delivered (audit #{done.audit['id']})")
    return 0


def _resolve(ops: Operations, args: argparse.Namespace, reply_id: str) -> Decided:
    """Resolve one dead message (or say why not, or what a dry run would do)."""
    if args.dry_run:
        return Decided(reply_id, "would resolve")
    try:
        audit = ops.resolve(reply_id, reason=args.reason, by=operator(args))
    except ResolveRefused as exc:
        return Decided(reply_id, "refused", str(exc))
    return Decided(reply_id, "resolved", audit=audit)
