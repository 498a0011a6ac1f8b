"""A requeue asked for on the console, taken by `outbox dead requeue`'s own Requeuer: the
receipt lookup first, a refusal unless a confirmed force overrides it, the audit row with
the operator's name."""

from __future__ import annotations

import argparse

from outbox.operations import Operations
from outbox.states import MessageState
from outbox_cli.requeue import REFUSALS, Requeued, Requeuer


def requeue(
    ops: Operations,
    config: str | None,
    reply_id: str,
    *,
    reason: str,
    by: str,
    overriding: str | None = None,
) -> Requeued:
    """Requeue one dead message as `outbox dead requeue REPLY_ID --reason --by` does;
    `overriding` is the receipt lookup's answer a confirmed refusal forces past (only
    that one: another answer is a refusal of its own)."""
    if not reason.strip() or not by.strip():
        return Requeued(reply_id, "refused", "a reason and the operator's name are both required")
    message = ops.message(reply_id)
    if message is None:
        return Requeued(reply_id, "refused", f"no message {reply_id!r}")
    if message["state"] != MessageState.DEAD:
        return Requeued(reply_id, "refused", f"message is {message['state']}, not dead")
    args = argparse.Namespace(
        config=config, force=False, dry_run=False, reason=reason.strip(), by=by.strip()
    )
    return Requeuer(ops, args).requeue(message, overriding)


def refused(reply_id: str, why: str) -> Requeued:
    """A requeue refused before anything was asked."""
    return Requeued(reply_id, "refused", why)


def forceable(done: Requeued) -> bool:
    """Whether a refusal came from the receipt lookup's answer, which force overrides."""
    return done.outcome == "refused" and done.why == REFUSALS.get(done.receipt)


def check_config(ops: Operations, config: str | None) -> None:
    """Read the destinations' receipt lookups once at start, so a bad config fails early."""
    Requeuer(ops, argparse.Namespace(config=config, force=False, dry_run=True, reason="", by=""))
