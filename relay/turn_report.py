"""What a settled turn tells: a log line per message that did not go out, the metrics
counted per kind, one summary line per turn, and whether it freed an ordering key."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from relay.answers import AnswerBook, destination_fault
from relay.metrics import RelayMetrics
from relay.policy import Outcome, Sent, Unsent, Verdict, verdict
from relay.records import Message

log = logging.getLogger("outbox.relay")


def report_turn(
    everything: Sequence[Message],
    outcomes: Mapping[int, Outcome],
    settled: set[int],
    metrics: RelayMetrics,
    key_freed: asyncio.Event | None,
    answers: AnswerBook | None = None,
    looked_up: Collection[int] = (),
) -> list[tuple[str, Verdict]]:
    """Log and count a turn whose `settled` ids this relay recorded; each one's verdict.

    `key_freed` is set when a keyed message ended sent or dead: its key's next message
    may go (the relay loop claims again at once). `answers` is told which destinations
    accepted a delivery in the turn and which failed an attempt in a way that is the
    destination's (relay.answers.destination_fault), leaving out the `looked_up` messages,
    of which no delivery was attempted.
    """
    verdicts: list[tuple[str, Verdict]] = []
    # Counted per kind, not per message: a batch is mostly one kind.
    kinds: Counter[tuple[str, Verdict, int | None]] = Counter()
    failures: dict[str, tuple[int | None, str]] = {}
    for message in everything:
        if message.id not in settled:
            log.warning("message %s was taken over; not settled here", message.reply_id)
            metrics.lease_lost(message.destination)
            continue
        outcome = outcomes[message.id]
        said = verdict(outcome)
        kinds[message.destination, said, outcome.status] += 1
        if not isinstance(outcome, Sent):
            if destination_fault(outcome) and message.id not in looked_up:
                failures[message.destination] = (outcome.status, outcome.error)
            fields = {
                "reply_id": message.reply_id,
                "destination": message.destination,
                "outcome": said,
                "status": outcome.status,
                "reason": outcome.error,
            }
            # A message going dead needs someone's decision; a retry is routine; one
            # never attempted (held behind its key, or no time left in the lease) is
            # routine and can be a thousand a turn behind one failing message.
            level = logging.WARNING if said == "dead" else logging.INFO
            log.log(
                logging.DEBUG if isinstance(outcome, Unsent) else level,
                "message %s to %s %s: %s",
                message.reply_id,
                message.destination,
                said,
                outcome.error,
                extra={"fields": fields},
            )
        verdicts.append((message.reply_id, said))
        if message.ordering_key is not None and said != "retry" and key_freed is not None:
            key_freed.set()
    totals = dict.fromkeys(("sent", "retry", "dead"), 0)
    for (destination, kind, status), count in kinds.items():
        metrics.record(destination, kind, status, count)
        totals[kind] += count
    if answers is not None:
        sent = {destination for destination, kind, _ in kinds if kind == "sent"}
        if looked_up:
            # A receipt found for a spent message is no delivery of this turn's: per message,
            # in the rare turn that looked some up.
            sent = {
                m.destination
                for m in everything
                if m.id in settled and m.id not in looked_up and isinstance(outcomes[m.id], Sent)
            }
        answers.record_turn(sent, failures)
    part = everything[0].destination if everything else None
    log.info(
        "turn for %s: %d claimed, %d settled: %d sent, %d retried, %d dead",
        part,
        len(everything),
        len(verdicts),
        totals["sent"],
        totals["retry"],
        totals["dead"],
        extra={
            "fields": {
                "destination": part,
                "claimed": len(everything),
                "settled": len(verdicts),
                **totals,
            }
        },
    )
    return verdicts
