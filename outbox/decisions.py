"""Decisions about dead messages: requeue and resolve, one audited decision per message.

An operator decides about one reply_id, or about every dead message a filter chooses
(Operations.dead). A requeue first asks the destination's receipt lookup and refuses
what the destination already holds or cannot be asked about, unless forced; a resolve
asks nothing, the operator vouching that no delivery is needed. Both return one record
per message: what was done, or would be in a dry run, or refused and why. Nothing here
prints: the `outbox` command and the console render the records.

The receipt lookup is the caller's (`ReceiptLookup`): asking a destination is the
relay's business, which the core does not import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from outbox.dead_filter import DeadFilter
from outbox.errors import NotDead
from outbox.operations import RECEIPT_ANSWERS, Operations, check_decision
from outbox.states import MessageState

BULK_LIMIT = 10_000
"""At most this many messages a filter chooses, unless the caller says otherwise."""
PER_TRANSACTION = 200
"""Decisions about the messages a filter chose share a transaction this many at a time:
a commit each would make a bulk decision wait for one disk flush per message."""

REFUSALS = {
    "received": "the destination already holds this exact message",
    "other body": "the destination holds this reply_id with another body (a conflict)",
    "unknown": "the destination's receipt lookup did not answer",
    "not checked": "nothing could be asked whether the destination holds it",
}
"""The receipt lookup's answers that refuse a requeue unless forced, and why each does."""

ReceiptLookup = Callable[[Sequence[Mapping[str, Any]]], Sequence[str]]
"""Asks whether the destinations hold these dead messages (rows of Operations.dead or
Operations.message: destination, reply_id, content_hash): one answer of
RECEIPT_ANSWERS per message, in order."""

Chosen = str | DeadFilter
"""What a decision is about: one reply_id, or every dead message a filter chooses."""

Progress = Callable[[int, int], None]
"""Told (messages decided so far, messages chosen) after each decision."""


@dataclass
class Decision:
    """What a decision did with one message."""

    reply_id: str
    outcome: str
    """The verb's past tense ("requeued", "resolved"), "would" and the verb in a dry run,
    or "refused"."""
    why: str | None = None
    """Why it was refused; None otherwise."""
    audit: dict[str, Any] | None = None
    """The audit row the decision wrote; None when nothing was changed."""


@dataclass
class RequeueDecision(Decision):
    """What a requeue did with one message, and what its receipt lookup said."""

    receipt: str = "not checked"
    """The receipt lookup's answer (one of RECEIPT_ANSWERS)."""

    @property
    def forceable(self) -> bool:
        """Whether it was refused for the receipt lookup's answer, which force overrides."""
        return self.outcome == "refused" and self.why == REFUSALS.get(self.receipt)


def nothing_asked(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The receipt lookup of a caller that can ask no destination: "not checked" for all."""
    return ["not checked"] * len(messages)


def dead_message(ops: Operations, reply_id: str) -> dict[str, Any]:
    """The dead message `reply_id` names (Operations.message); NotDead when it is none."""
    message = ops.message(reply_id)
    if message is None:
        raise NotDead(reply_id, None)
    if message["state"] != MessageState.DEAD:
        raise NotDead(reply_id, str(message["state"]))
    return message


def chosen_messages(
    ops: Operations, chosen: Chosen, limit: int = BULK_LIMIT
) -> list[dict[str, Any]]:
    """The dead messages a decision is about: the one reply_id names (NotDead when it is no
    dead message), or the first `limit` a filter chooses, oldest first."""
    if isinstance(chosen, str):
        return [dead_message(ops, chosen)]
    return ops.dead(limit, chosen)


def requeue(
    ops: Operations,
    chosen: Chosen,
    *,
    reason: str,
    by: str,
    lookup: ReceiptLookup = nothing_asked,
    force: bool = False,
    overriding: str | None = None,
    dry_run: bool = False,
    limit: int = BULK_LIMIT,
    progress: Progress | None = None,
) -> list[RequeueDecision]:
    """Requeue the chosen dead messages, each after its receipt lookup; one record each.

    An answer of REFUSALS refuses the message unless `force`, or unless it is the
    `overriding` answer (a refusal the operator confirmed: another answer is a refusal of
    its own). A dry run asks the lookups and changes nothing. Raises NotDead when
    `chosen` is a reply_id that is no dead message, ValueError without a reason or an
    operator (`by`), both kept in each audit row.
    """
    check_decision(reason, by)
    messages = chosen_messages(ops, chosen, limit)
    answers = list(lookup(messages)) if messages else []
    if len(answers) != len(messages):
        raise ValueError(f"the receipt lookup gave {len(answers)} answers for {len(messages)}")
    for answer in answers:
        if answer not in RECEIPT_ANSWERS:
            raise ValueError(f"receipt must be one of {RECEIPT_ANSWERS}, got {answer!r}")

    def requeue_batch(
        ops: Operations, batch: Sequence[tuple[Mapping[str, Any], str]]
    ) -> list[RequeueDecision]:
        decided: dict[int, RequeueDecision] = {}
        wanted: list[tuple[int, str, str, bool]] = []
        for index, (message, receipt) in enumerate(batch):
            reply_id = message["reply_id"]
            forced = force or (receipt in REFUSALS and receipt == overriding)
            if receipt in REFUSALS and not forced:
                decided[index] = RequeueDecision(
                    reply_id, "refused", REFUSALS[receipt], receipt=receipt
                )
            elif dry_run:
                decided[index] = RequeueDecision(reply_id, "would requeue", receipt=receipt)
            else:
                wanted.append((index, reply_id, receipt, forced))
        if wanted:
            done = ops.requeue_many([one[1:] for one in wanted], reason=reason, by=by)
            for (index, reply_id, receipt, _), outcome in zip(wanted, done, strict=True):
                decided[index] = (
                    RequeueDecision(reply_id, "refused", outcome, receipt=receipt)
                    if isinstance(outcome, str)
                    else RequeueDecision(reply_id, "requeued", audit=outcome, receipt=receipt)
                )
        return [decided[index] for index in range(len(batch))]

    chosen_ones = list(zip(messages, answers, strict=True))
    return _batches(ops, chosen_ones, requeue_batch, progress, write=not dry_run)


def resolve(
    ops: Operations,
    chosen: Chosen,
    *,
    reason: str,
    by: str,
    dry_run: bool = False,
    limit: int = BULK_LIMIT,
    progress: Progress | None = None,
) -> list[Decision]:
    """Settle the chosen dead messages as needing no delivery, for good; one record each.

    Nothing is asked of the destination. A dry run changes nothing. Raises NotDead when
    `chosen` is a reply_id that is no dead message, ValueError without a reason or an
    operator (`by`).
    """
    check_decision(reason, by)
    messages = chosen_messages(ops, chosen, limit)

    def resolve_batch(ops: Operations, batch: Sequence[Mapping[str, Any]]) -> list[Decision]:
        reply_ids = [message["reply_id"] for message in batch]
        if dry_run:
            return [Decision(reply_id, "would resolve") for reply_id in reply_ids]
        done = ops.resolve_many(reply_ids, reason=reason, by=by)
        return [
            Decision(reply_id, "refused", outcome)
            if isinstance(outcome, str)
            else Decision(reply_id, "resolved", audit=outcome)
            for reply_id, outcome in zip(reply_ids, done, strict=True)
        ]

    return _batches(ops, messages, resolve_batch, progress, write=not dry_run)


D = TypeVar("D", bound=Decision)


C = TypeVar("C")


def _batches(
    ops: Operations,
    chosen: Sequence[C],
    decide_batch: Callable[[Operations, Sequence[C]], list[D]],
    progress: Progress | None,
    *,
    write: bool,
) -> list[D]:
    """Decide about the chosen messages PER_TRANSACTION at a time (requeue_batch,
    resolve_batch), each batch in a transaction of its own when they `write` (a database
    error rolls back its batch alone, and raises), telling `progress` after each batch."""
    results: list[D] = []
    for start in range(0, len(chosen), PER_TRANSACTION):
        batch = chosen[start : start + PER_TRANSACTION]
        if write:
            with ops.together() as shared:
                decided = decide_batch(shared, batch)
        else:  # a dry run changes nothing: no transaction to hold open
            decided = decide_batch(ops, batch)
        for decision in decided:
            results.append(decision)
            if progress is not None:
                progress(len(results), len(chosen))
    return results
