"""The failures of each message's effect a consumer counts: its backoff and its last try.

Only the effect's own failures count, in this process (a restart gives a message a fresh
budget), each at least its backoff after the one before: a ``held`` message, or a batch
the database failed whole, is not one. The try after ``max_deliveries - 1`` failures is
the last: if the effect raises again, the message goes to the dead letters.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from outbox.backoff import backoff_ceiling
from receiver.dead_letters import LastTry
from receiver.deliveries import Delivery
from receiver.store import BatchItem, Statuses

FAILURES_KEPT = 10_000
"""Messages whose effect failures a consumer counts at once; past it the oldest count is
forgotten (that message then gets a fresh budget: more tries, never fewer)."""
UNKEPT_HEADERS = frozenset({"webhook-signature", "authorization", "proxy-authorization", "cookie"})
"""Headers a dead letter leaves out: credentials, and a signature nobody needs again."""


class EffectFailures:
    """Per reply_id whose effect raised: how often, and when it may be tried again."""

    def __init__(self, max_deliveries: int, backoff: float, backoff_cap: float) -> None:
        """Back off `backoff` seconds, doubling per failure up to `backoff_cap`; a message's
        try after `max_deliveries` - 1 failures is its last."""
        self.max_deliveries = max_deliveries
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self._failures: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        """reply_id -> (deliveries whose effect raised, monotonic time it may run again)."""

    def backing_off(self, reply_id: str, now: float) -> bool:
        """Whether `reply_id`'s effect raised less than its backoff before `now`."""
        failed = self._failures.get(reply_id)
        return failed is not None and now < failed[1]

    def last_tries(
        self, items: Sequence[BatchItem], deliveries: Sequence[Delivery], broker: str | None
    ) -> dict[int, LastTry]:
        """The items whose effect has raised max_deliveries - 1 times: this try is their last."""
        last: dict[int, LastTry] = {}
        for index, (item, delivery) in enumerate(zip(items, deliveries, strict=True)):
            failures = self._failures.get(item[0], (0, 0.0))[0] + 1
            if failures >= self.max_deliveries:
                last[index] = LastTry(
                    headers={
                        name: value
                        for name, value in delivery.headers.items()
                        if name not in UNKEPT_HEADERS
                    },
                    failures=failures,
                    deliveries=delivery.deliveries,
                    broker=broker,
                    broker_ref=delivery.broker_ref,
                )
        return last

    def count(self, items: Sequence[BatchItem], statuses: Statuses | list[str], now: float) -> None:
        """Count a failure for each item whose effect raised, and when it may be tried
        again (backoff, doubling per failure, capped); forget the settled ones."""
        errors = getattr(statuses, "errors", {})
        for index, (item, status) in enumerate(zip(items, statuses, strict=True)):
            reply_id = item[0]
            if status == "retry" and index in errors:
                # Only the effect's own failures count: not a held message, nor a batch the
                # database failed whole (that one raised before any status).
                failures = self._failures.get(reply_id, (0, 0.0))[0] + 1
                # The ceiling, not a draw: each try at least its backoff after the last.
                wait = backoff_ceiling(failures, self.backoff, self.backoff_cap)
                self._failures[reply_id] = (failures, now + wait)
                self._failures.move_to_end(reply_id)
                while len(self._failures) > FAILURES_KEPT:
                    self._failures.popitem(last=False)
            elif status != "held":
                self._failures.pop(reply_id, None)
