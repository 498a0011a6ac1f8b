"""The console's requeue form: the requeue an operator asks for on the dead-message page.

It is decided by outbox.decisions as `outbox dead requeue`'s are: the receipt lookup
first (the destinations the relay's configuration names), a refusal unless a confirmed
force overrides it, the audit row with the operator's name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from outbox import decisions
from outbox.decisions import RequeueDecision
from outbox.errors import NotDead
from outbox.operations import Operations
from outbox_cli.requeue import DestinationLookups


def requeue(
    ops: Operations,
    config: str | None,
    reply_id: str,
    *,
    reason: str,
    by: str,
    overriding: str | None = None,
) -> RequeueDecision:
    """Requeue one dead message as `outbox dead requeue REPLY_ID --reason --by` does;
    `overriding` is the receipt lookup's answer a confirmed refusal forces past (only
    that one: another answer is a refusal of its own)."""
    if not reason.strip() or not by.strip():
        return refused(reply_id, "a reason and the operator's name are both required")

    def lookup(messages: Sequence[Mapping[str, Any]]) -> list[str]:
        # Read when asked, as the command does: a config file changed since start counts.
        return DestinationLookups(config)(messages)

    try:
        [done] = decisions.requeue(
            ops,
            reply_id,
            reason=reason.strip(),
            by=by.strip(),
            lookup=lookup,
            overriding=overriding,
        )
    except NotDead as exc:
        why = (
            f"no message {reply_id!r}" if exc.state is None else f"message is {exc.state}, not dead"
        )
        return refused(reply_id, why)
    return done


def refused(reply_id: str, why: str) -> RequeueDecision:
    """A requeue refused before anything was asked."""
    return RequeueDecision(reply_id, "refused", why)


def forceable(done: RequeueDecision) -> bool:
    """Whether a refusal came from the receipt lookup's answer, which force overrides."""
    return done.forceable


def check_config(config: str | None) -> None:
    """Read the destinations' receipt lookups once at start, so a bad config fails early."""
    DestinationLookups(config)
