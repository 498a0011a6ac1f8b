"""How the suite picks a swept ceiling and judges a comparison run in both orders."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks import bare_broker_relay, bare_relay, broker_ceiling, broker_drain, suite, sweep
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
    """One run's figures as the drain comparison records them (the sweep's and the winner's
    own measurement), the sweep won at `point`."""
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


def test_choosing_a_point_measures_each_point_once_and_names_the_fastest() -> None:
    asked: list[sweep.Point] = []
    rates = {sweep.Point(500, 1): 100.0, sweep.Point(1000, 4): 300.0}

    def rate(point: sweep.Point) -> float:
        asked.append(point)
        return rates[point]

    figures, winner = sweep.chosen("bare", list(rates), rate)
    assert winner == sweep.Point(1000, 4)
    assert asked == list(rates)  # the ceiling's own measurement is the caller's to take
    assert figures == {
        "bare_500x1": 100.0,
        "bare_1000x4": 300.0,
        "bare_batch": 1000.0,
        "bare_in_flight": 4.0,
    }


def test_a_drains_baselines_are_measured_right_between_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    points = (sweep.Point(500, 1), sweep.Point(1000, 4))

    # Every measurement gives a figure of its own (its place in the run), so each figure
    # names the drain it came from.
    def bare(total: int, point: sweep.Point, relays: int = 2) -> dict[str, float]:
        calls.append(f"bare {point.label}")
        rate = float(len(calls)) + (100.0 if point.batch == 1000 else 0.0)
        return {"rate": rate, "cpu_us_relay": float(len(calls))}

    def our_drain(total: int) -> dict[str, float]:
        calls.append("ours")
        return {"rate": float(len(calls)), "cpu_us_relay": float(len(calls))}

    def named(name: str) -> Callable[..., float]:
        def measured(*args: object, **kwargs: object) -> float:
            calls.append(name)
            return float(len(calls))

        return measured

    monkeypatch.setattr(bare_relay, "bare_drain", bare)
    monkeypatch.setattr(bare_relay, "ours_drain", our_drain)
    monkeypatch.setattr(suite, "naive_drain", named("naive"))
    monkeypatch.setattr(suite, "complete_rate", named("effect"))
    monkeypatch.setattr(suite, "drain", lambda *args, **kwargs: {})
    monkeypatch.setattr(suite, "sqlite_drain", named("sqlite"))
    monkeypatch.setattr(suite, "mysql_drain", named("mysql"))
    figures = suite.drains(suite.Sizes.of(quick=True), points)
    assert calls == [
        "bare 500x1",  # 1: the sweep first, choosing the point
        "bare 1000x4",
        "ours",  # 3
        "bare 1000x4",  # 4: the winner again, between two drains of ours
        "ours",  # 5
        "naive",  # 6: between two drains of ours too
        "ours",  # 7
        "effect",  # 8: against the drain before it
        "sqlite",
        "mysql",
    ]
    assert (figures["bare_500x1"], figures["bare_1000x4"]) == (1.0, 102.0)
    assert (figures["ours"], figures["ours_cpu_us_relay"]) == (3.0, 3.0)
    assert (figures["bare"], figures["bare_cpu_us_relay"]) == (104.0, 4.0)
    assert (figures["ours_after"], figures["baseline"], figures["ours_last"]) == (5.0, 6.0, 7.0)
    assert figures["ours_effect"] == 8.0


def test_a_brokers_baselines_are_measured_right_between_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    points = (sweep.Point(500, 1), sweep.Point(1000, 4))

    def rate(name: str) -> Callable[[str, int, sweep.Point], float]:
        def measured(kind: str, total: int, point: sweep.Point) -> float:
            calls.append(f"{kind} {name} {point.label}")
            return float(len(calls)) + (100.0 if point.batch == 1000 else 0.0)

        return measured

    def ours(kind: str, total: int, then_consume: bool = True) -> dict[str, float]:
        calls.append(f"{kind} ours" + (" and consume" if then_consume else ""))
        figures = {kind: float(len(calls)), f"{kind}_cpu_us": float(len(calls))}
        return figures | ({f"{kind}_consume": -float(len(calls))} if then_consume else {})

    def http_drain(total: int) -> dict[str, float]:
        calls.append("http")
        return {"http": float(len(calls))}

    monkeypatch.setattr(broker_ceiling, "bare_publish", rate("publishers"))
    monkeypatch.setattr(bare_broker_relay, "bare_relay_drain", rate("relays"))
    monkeypatch.setattr(broker_drain, "broker_drain", ours)
    monkeypatch.setattr(broker_drain, "http_drain", http_drain)
    figures = suite.broker_comparisons(True, points)
    sweeps = [
        f"{kind} {name} {point.label}"
        for kind in ("nats", "rabbitmq")
        for name in ("publishers", "relays")
        for point in points
    ]
    assert calls == [
        *sweeps,  # 1-8: every sweep first, choosing the points
        "http",  # 9
        "nats ours",  # 10
        "nats relays 1000x4",  # 11: right after ours first
        "nats publishers 1000x4",  # 12: right before ours after
        "nats ours and consume",  # 13
        "rabbitmq ours",
        "rabbitmq relays 1000x4",
        "rabbitmq publishers 1000x4",
        "rabbitmq ours and consume",
        "http",  # 18
    ]
    assert (figures["http"], figures["nats"], figures["nats_cpu_us"]) == (9.0, 10.0, 10.0)
    assert (figures["nats_bare_relay"], figures["nats_bare"]) == (111.0, 112.0)
    assert (figures["nats_after"], figures["nats_consume"]) == (13.0, -13.0)
    assert (figures["nats_bare_relay_1000x4"], figures["nats_bare_1000x4"]) == (104.0, 102.0)
    assert figures["http_after"] == 18.0
