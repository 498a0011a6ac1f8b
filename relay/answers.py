"""Each destination's last answers as this relay saw them: what its announcements carry, so
the console can say a destination is failing without reading the history."""

from __future__ import annotations

import threading
import time

from outbox.clock import Clock
from outbox.drivers.records import NO_ANSWERS, LastAnswers


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

    def sent(self, destination: str) -> None:
        """A delivery to `destination` was accepted just now."""
        moment = self._now()
        with self._lock:
            self._sent[destination] = moment

    def failed(self, destination: str, status: int | None, error: str) -> None:
        """An attempt at `destination` failed just now, with `status` (None: no answer)."""
        moment = self._now()
        with self._lock:
            self._failed[destination] = (moment, status, error)

    def ages(self) -> dict[str, LastAnswers]:
        """Each destination's last answers, as seconds before now."""
        moment = self._now()
        with self._lock:
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
