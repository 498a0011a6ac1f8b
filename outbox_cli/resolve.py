"""`outbox dead resolve`: settle dead messages as needing no delivery, for good, audited.

The operator vouches that a dead message needs no delivery (the destination
confirmed it some other way, or it no longer matters), so nothing is asked of
the destination. A resolved message is final: never delivered, never requeued,
and `outbox purge` deletes it once old enough, as it does sent ones. The decisions
are outbox.decisions.resolve's; here, the report.
"""

from __future__ import annotations

import argparse
import sys

from outbox import decisions
from outbox.errors import NotDead
from outbox.operations import Operations
from outbox_cli.arguments import print_json
from outbox_cli.decisions import chosen_many, operator, progress, report_many, say_not_dead


def run(ops: Operations, args: argparse.Namespace) -> int:
    """Run `outbox dead resolve`; returns the exit status."""
    chosen = chosen_many(args, "resolve")
    try:
        done = decisions.resolve(
            ops,
            args.reply_id if chosen is None else chosen,
            reason=args.reason,
            by=operator(args),
            dry_run=args.dry_run,
            limit=args.limit,
            progress=progress(args),
        )
    except NotDead as exc:
        say_not_dead(exc)
        return 1
    if chosen is not None:
        return report_many(done, args, "resolve", "resolved")
    [one] = done
    if one.outcome == "refused":
        print(f"outbox: not resolved: {one.why}", file=sys.stderr)
        return 1
    if args.json:
        print_json(one.audit if one.audit is not None else vars(one))
    elif one.audit is None:
        print(f"would resolve {args.reply_id!r}")
    else:
        print(f"resolved {args.reply_id!r}: it will not be delivered (audit #{one.audit['id']})")
    return 0
