"""The one backoff formula: its ceiling, table-driven, and the jitter drawn under it."""

from __future__ import annotations

import random

import pytest

from outbox.backoff import backoff_ceiling, backoff_delay


@pytest.mark.parametrize(
    ("attempt", "backoff", "cap", "ceiling"),
    [
        (1, 2.0, 300.0, 2.0),
        (2, 2.0, 300.0, 4.0),
        (5, 2.0, 300.0, 32.0),
        (9, 2.0, 300.0, 300.0),  # 512 capped
        (0, 2.0, 300.0, 2.0),  # never below the first backoff
        (10_000, 0.5, 30.0, 30.0),  # a huge attempt does not overflow
    ],
)
def test_the_ceiling_doubles_per_failure_up_to_the_cap(
    attempt: int, backoff: float, cap: float, ceiling: float
) -> None:
    assert backoff_ceiling(attempt, backoff, cap) == ceiling


@pytest.mark.parametrize("attempt", [1, 3, 7, 40])
def test_a_delay_is_drawn_between_half_the_ceiling_and_the_ceiling(attempt: int) -> None:
    rng = random.Random(7)
    ceiling = backoff_ceiling(attempt, 1.0, 60.0)
    delays = [backoff_delay(attempt, 1.0, 60.0, rng) for _ in range(500)]
    assert all(ceiling / 2 <= d <= ceiling for d in delays)
    # Spread over the range, not one value: the jitter is there.
    assert max(delays) - min(delays) > ceiling / 4
