"""Probe: database reads for /metrics and /readyz, answered within a deadline."""

from __future__ import annotations

import threading

import pytest

from outbox.observability import probe as probes
from outbox.observability.probe import Probe


def test_a_read_that_does_not_answer_in_time_reads_as_none_and_is_not_doubled() -> None:
    release = threading.Event()
    calls: list[int] = []

    def hanging() -> int:
        calls.append(1)
        release.wait(10)
        return 7

    read = Probe(hanging, deadline=0.05, max_age=0.0)
    assert read() is None
    assert read() is None  # the first read still runs: no second one beside it
    assert len(calls) == 1
    release.set()


def test_a_read_stuck_past_its_limit_no_longer_speaks_for_the_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(probes, "STUCK", 0.0)
    stuck = threading.Event()
    answers = iter([stuck, None])

    def read_once() -> int:
        gate = next(answers)
        if gate is not None:
            gate.wait(10)  # the first read hangs, as on a half-open connection
            return 1
        return 2

    read = Probe(read_once, deadline=0.2, max_age=0.0)
    assert read() is None
    assert read() == 2  # a new read started beside the stuck one, and answered
    stuck.set()


def test_a_failing_read_is_none_and_a_good_one_is_kept_for_max_age() -> None:
    values = iter([RuntimeError("down"), 5, 6])

    def flaky() -> int:
        value = next(values)
        if isinstance(value, Exception):
            raise value
        return value

    read = Probe(flaky, deadline=1.0, max_age=0.0)
    assert read() is None
    assert read() == 5
    kept = Probe(lambda: object(), deadline=1.0, max_age=60.0)
    assert kept() is kept()  # one read within max_age
