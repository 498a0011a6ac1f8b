"""The relay's pure policies, table-driven: classification, Retry-After, backoff, windows."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from relay.policy import (
    Dead,
    Retry,
    Sent,
    classify,
    longest_retry_window,
    parse_retry_after,
    retry_delay,
    truncate,
)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (200, Sent), (201, Sent), (204, Sent), (299, Sent),
        (408, Retry), (425, Retry), (429, Retry), (500, Retry), (502, Retry), (503, Retry),
        (599, Retry),
        (301, Dead), (304, Dead), (400, Dead), (401, Dead), (403, Dead), (404, Dead),
        (409, Dead), (410, Dead), (413, Dead), (415, Dead), (422, Dead), (451, Dead),
    ],
)  # fmt: skip
def test_classification(status: int, kind: type) -> None:
    outcome = classify(status)
    assert isinstance(outcome, kind)
    assert outcome.status == status


def test_conflict_says_so_and_retry_keeps_the_hint() -> None:
    conflict = classify(409, detail="other body")
    assert isinstance(conflict, Dead)
    assert "conflict" in conflict.error
    throttled = classify(429, retry_after="7")
    assert isinstance(throttled, Retry)
    assert throttled.after == 7.0


def test_retry_after_forms() -> None:
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(datetime(2026, 11, 29, 12, 0, 30, tzinfo=UTC), usegmt=True)
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(later, now=now.timestamp()) == pytest.approx(30.0)
    assert parse_retry_after("Wed, 01 Jan 2020 00:00:00 GMT", now=now.timestamp()) == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-5") is None


@pytest.mark.parametrize(("attempt", "ceiling"), [(1, 2.0), (2, 4.0), (3, 8.0), (9, 60.0)])
def test_backoff_is_jittered_within_half_to_full_and_capped(attempt: int, ceiling: float) -> None:
    rng = random.Random(7)
    delays = [retry_delay(attempt, 2.0, 60.0, None, rng) for _ in range(200)]
    assert min(delays) >= ceiling / 2
    assert max(delays) <= ceiling
    assert max(delays) - min(delays) > ceiling / 10  # really jittered


def test_retry_after_is_honoured_within_the_cap() -> None:
    rng = random.Random(1)
    assert retry_delay(1, 2.0, 60.0, 7.0, rng) == 7.0
    assert retry_delay(1, 2.0, 60.0, 9999.0, rng) == 60.0
    assert retry_delay(1, 2.0, 60.0, 0.0, rng) == 1.0  # never a tight loop


def test_longest_retry_window_covers_capped_waits_and_lease_expiries() -> None:
    assert longest_retry_window(1, 2, 300, 10, 30) == 40
    assert longest_retry_window(3, 2, 300, 10, 30) == 2 * 300 + 3 * 40


def test_truncated_errors_are_short_single_line_and_printable() -> None:
    text = truncate("a\nb\x00c\x1b[31m" + "x" * 1000)
    assert len(text) == 500
    assert text.isprintable()
    assert text.startswith("a b?c?[31m")
