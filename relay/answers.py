"""Each destination's last answers as this relay saw them: what its announcements carry, so
the console can say a destination is failing without reading the history."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import TypeGuard

from outbox.clock import Clock
from outbox.drivers.records import NO_ANSWERS, LastAnswers
from relay.policy import Dead, Outcome, Retry


def destination_fault(outcome: Outcome) -> TypeGuard[Retry | Dead]:
    """Whether an outcome says the destination is not taking deliveries: a retry (no answer,
    a timeout, a 5xx, 408, 425 or 429), or a message dead for a reason of the destination's
    (Dead.of_destination: credentials refused, an endpoint or exchange missing, retries
    spent). A refusal of one message (a 409 conflict, a 422, a header NATS reserves) says
    nothing of the destination's health: it shows as dead, not as a failing destination."""
    if isinstance(outcome, Retry):
        return True
    return isinstance(outcome, Dead) and outcome.of_destination


class AnswerBook:
    """The last accepted delivery and the last failed attempt per destination, by when.

    Written by the loop's settled turns, read by the claims' thread at each announcement:
    ages, on the relay's manual clock in tests, else on the monotonic clock, so that a
    relay host's wrong wall clock cannot move them (the database writes its own time less
    the age).
    """

    def __init__(self, clock: Clock | None = None) -> None:
        """Nothing answered yet."""
        self._now = clock or time.monotonic
        self._lock = threading.Lock()
        self._sent: dict[str, float] = {}
        self._failed: dict[str, tuple[float, int | None, str]] = {}

    def record_turn(
        self, sent: Iterable[str], failed: Mapping[str, tuple[int | None, str]]
    ) -> None:
        """A settled turn's answers, all at one moment: the destinations that accepted a
        delivery, and per destination its failed attempt's (status, error). A delivery and
        a failure of one turn are simultaneous: neither is the other's "last"."""
        with self._lock:
            moment = self._now()
            for destination in sent:
                self._sent[destination] = moment
            for destination, (status, error) in failed.items():
                self._failed[destination] = (moment, status, error)

    def ages(self) -> dict[str, LastAnswers]:
        """Each destination's last answers, as seconds before now."""
        with self._lock:
            moment = self._now()
            names = self._sent.keys() | self._failed.keys()
            answers = {}
            for name in names:
                sent = self._sent.get(name)
                failed = self._failed.get(name)
                answer = NO_ANSWERS._replace(sent_age=None if sent is None else moment - sent)
                if failed is not None:
                    at, status, error = failed
                    answer = answer._replace(failed_age=moment - at, status=status, error=error)
                answers[name] = answer
            return answers
