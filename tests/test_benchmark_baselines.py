"""How the suite picks a swept ceiling and judges a comparison run in both orders."""

from __future__ import annotations

import pytest

from benchmarks import sweep
from benchmarks.suite import (
    BASELINE_FIRST,
    OURS_FIRST,
    Sizes,
    by_order,
    keyed_rows,
    ordered_row,
    sweep_lines,
    tracing_rows,
)


def test_the_ceiling_is_the_fastest_point_measured_again_and_names_it() -> None:
    # Each point's figures in the order they are drawn: the winner's second draw is lower,
    # as a lucky first one would be followed by an ordinary one.
    draws = {
        sweep.Point(500, 1): [100.0],
        sweep.Point(1000, 4): [300.0, 240.0],
        sweep.Point(1000, 8): [250.0],
    }
    asked: list[sweep.Point] = []

    def rate(point: sweep.Point) -> float:
        asked.append(point)
        return draws[point].pop(0)

    figures = sweep.swept("bare", list(draws), rate)
    assert figures == {
        "bare_500x1": 100.0,
        "bare_1000x4": 300.0,
        "bare_1000x8": 250.0,
        "bare": 240.0,
        "bare_batch": 1000.0,
        "bare_in_flight": 4.0,
    }
    # Every point once, then the winner once more, after the whole sweep.
    assert asked == [*draws, sweep.Point(1000, 4)]


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


def test_keyed_rows_judge_each_shape_against_the_unkeyed_drains_of_its_size() -> None:
    keyed = [
        {
            "small": 1000.0,
            "one_key": 400.0,
            "small_after": 800.0,
            "large": 1000.0,
            "few_keys": 850.0,
            "many_keys": 500.0,
            "large_after": 1000.0,
            "one_key_single": 65.0,
        }
    ]
    paced = [{"ours_p50_ms": 10.0, "keyed_p50_ms": 14.0, "ours_after_p50_ms": 8.0}]
    paced[0] |= {"ours_p99_ms": 20.0, "keyed_p99_ms": 30.0, "ours_after_p99_ms": 20.0}
    rows = {row.scenario.split(" (")[0]: row for row in keyed_rows(Sizes.of(False), keyed, paced)}
    one_key = rows["keyed drain vs unkeyed, one key"]
    assert "(1 x 2,000 messages, batch)" in one_key.scenario
    # 400 / 1000 with the unkeyed drain first, 400 / 800 with it after: the lower is judged.
    assert one_key.orders == {OURS_FIRST: 0.5, BASELINE_FIRST: 0.4}
    assert (one_key.ratio, one_key.met) == (0.4, False)
    assert rows["keyed drain vs unkeyed, few long keys"].met is True  # 0.85 >= 0.8
    assert "(100 x 200 messages" in rows["keyed drain vs unkeyed, few long keys"].scenario
    assert "(10,000 x 2 messages" in rows["keyed drain vs unkeyed, many short keys"].scenario
    assert rows["keyed drain vs unkeyed, many short keys"].met is None
    single = rows["keyed drain rate, one key, single mode"]
    assert (single.ours, single.baseline, single.met) == (65.0, None, False)  # below 300/s
    p50 = rows["keyed live p50 vs unkeyed"]
    # 14 / 8 = 1.75 with the unkeyed run after it: the higher latency ratio is judged.
    assert (p50.ratio, p50.met) == (1.75, False)
    assert rows["keyed live p99 vs unkeyed"].met is None


def test_tracing_rows_pair_each_run_with_the_one_beside_it() -> None:
    # In run order: traced, off, absent, off_after, traced_after; live traced, off, after.
    drains = {
        "drain_traced": 800.0,
        "drain_off": 1000.0,
        "drain_absent": 1000.0,
        "drain_off_after": 900.0,
        "drain_traced_after": 630.0,
    }
    live = {"live_traced_p50_ms": 6.0, "live_off_p50_ms": 5.0, "live_traced_after_p50_ms": 7.0}
    rows = {row.scenario.split(" (")[0]: row for row in tracing_rows([drains | live])}
    traced = rows["drain, tracing configured and exporting vs not configured"]
    # 800 / 1000 traced first; 630 / 900 with the drain not configured first: 0.7 judged.
    assert traced.orders == {OURS_FIRST: 0.8, BASELINE_FIRST: 0.7}
    assert (traced.ratio, traced.met) == (0.7, False)
    unconfigured = rows["drain, opentelemetry-api installed but no provider vs not importable"]
    assert unconfigured.orders == {OURS_FIRST: 1.0, BASELINE_FIRST: 0.9}
    assert (unconfigured.ratio, unconfigured.met) == (0.9, False)  # under 0.95
    p50 = rows["live p50, tracing configured vs not configured"]
    assert "(4 x 50/s)" in p50.scenario
    # 6 / 5 traced first, 7 / 5 after: the higher latency ratio is judged against 1.25.
    assert p50.orders == {OURS_FIRST: 1.2, BASELINE_FIRST: 1.4}
    assert (p50.ratio, p50.met) == (1.4, False)
