"""How the suite picks a swept ceiling and judges a comparison run in both orders."""

from __future__ import annotations

import pytest

from benchmarks import sweep
from benchmarks.suite import BASELINE_FIRST, OURS_FIRST, by_order, ordered_row, sweep_lines


def test_the_ceiling_is_the_fastest_point_and_names_it() -> None:
    rates = {sweep.Point(500, 1): 100.0, sweep.Point(1000, 4): 300.0, sweep.Point(1000, 8): 250.0}
    figures = sweep.swept("bare", rates, rates.__getitem__)
    assert figures == {
        "bare_500x1": 100.0,
        "bare_1000x4": 300.0,
        "bare_1000x8": 250.0,
        "bare": 300.0,
        "bare_batch": 1000.0,
        "bare_in_flight": 4.0,
    }


def test_a_sweep_without_points_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one point"):
        sweep.swept("bare", [], lambda point: 1.0)


def test_the_full_grid_is_both_batches_by_one_four_and_eight_in_flight() -> None:
    labels = [point.label for point in sweep.grid(quick=False)]
    assert labels == ["500x1", "500x4", "500x8", "1000x1", "1000x4", "1000x8"]
    assert len(sweep.grid(quick=True)) > 1  # a smoke run still chooses between points


def run(ours: float, bare: float, ours_after: float, point: sweep.Point) -> dict[str, float]:
    """One run's figures as the drain comparison records them, the sweep won at `point`."""
    other = sweep.Point(500, 1)
    return {
        "ours": ours,
        "ours_after": ours_after,
        **sweep.swept("bare", [point, other], {point: bare, other: bare / 2}.__getitem__),
    }


def test_each_order_has_its_ratio_and_the_less_favourable_is_judged() -> None:
    runs = [
        run(80.0, 100.0, 70.0, sweep.Point(1000, 8)),
        run(90.0, 100.0, 60.0, sweep.Point(1000, 8)),
        run(85.0, 100.0, 75.0, sweep.Point(1000, 4)),
    ]
    row = ordered_row(
        f"drain vs bare relay (won: {sweep.winners('bare', runs)})",
        "postgresql",
        "messages/s",
        runs,
        ("ours", "bare"),
        ("ours_after", "bare"),
        ">= 0.8",
        lambda r: r >= 0.8,
        swept="bare",
    )
    assert row.orders == {OURS_FIRST: 0.85, BASELINE_FIRST: 0.7}
    assert row.ratio == 0.7
    assert row.met is False  # ours first alone would have met it
    assert row.ours == 77.5  # over both orders: 60, 70, 75, 80, 85, 90
    assert row.baseline == 100.0
    assert "1,000 x 8 (2 of 3 runs), 1,000 x 4 (1 of 3 runs)" in row.scenario
    assert by_order(row) == "ours first 0.85; baseline first 0.70"
    assert sweep_lines([row]) == [
        "- drain vs bare relay: 1000x8 100, 500x1 50, 1000x4 100 (messages/s)."
    ]


def test_a_latency_judges_the_higher_ratio() -> None:
    runs = [{"ours": 2.0, "ours_after": 3.0, "bare": 2.0}]
    row = ordered_row(
        "live p50 vs bare relay",
        "postgresql",
        "ms",
        runs,
        ("ours", "bare"),
        ("ours_after", "bare"),
        "<= 1.5",
        lambda r: r <= 1.5,
        worse=max,
    )
    assert row.ratio == 1.5
    assert row.met is True
