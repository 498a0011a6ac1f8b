"""The benchmark suite: each scenario beside its baseline, measured in the same run.

Run: .venv/bin/python -m benchmarks.suite [--quick] [--runs 3] [--json PATH] [--doc PATH]

Every scenario is run `--runs` times; each run measures ours and its baseline back
to back on fresh databases, so machine noise hits both. The drain, broker and paced
live comparisons measure each baseline between two measurements of ours, and give the
ratio of each order; the one judged is the less favourable to us. A swept baseline's
points are measured first, and its winner's figure between ours. The table gives medians and
the median of the per-run ratios, against the targets. Scenarios: publish overhead
(sync, and async on asyncpg), relay drain against a naive relay and against bare
relays at their sweep's fastest point, measured again (benchmarks.bare_relay, the
ceiling), drains into NATS JetStream and RabbitMQ against the HTTP batch drain and
against bare publishers and bare relays into the same broker, swept the same way,
with the consumers' rate (benchmarks.broker_drain, benchmarks.broker_ceiling,
benchmarks.bare_broker_relay), live latency, and against the bare relay at the same
paced producer rate, the cost of tracing (benchmarks.trace_cost: drain and paced
live latency traced and exporting against not configured, and not configured against
OpenTelemetry not importable), task throughput against PGQueuer, a worker's waiting
handlers and its NOTIFY wake-up (benchmarks.worker_waits), cost growth with a large
history, the database's cost per delivered message and per finished task
(benchmarks.db_cost), and the same drain, task throughput and publish on SQLite
files beside PostgreSQL (the SQLite rows' baseline is our PostgreSQL figure from the
same run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
import outbox.asyncio
import receiver
from benchmarks import (
    bare_broker_relay,
    bare_relay,
    broker_ceiling,
    broker_drain,
    console_pages,
    cost_growth,
    db_cost,
    profiles,
    receiver_cpu,
    sweep,
    task_throughput,
    trace_cost,
    worker_waits,
)
from benchmarks.databases import fresh_mysql_database
from benchmarks.relay_bench import (
    ROOT,
    SECRET,
    Backlog,
    drain,
    drain_backlog,
    fresh_database,
    keyed_drains,
    live,
    log,
    pending_row,
    prefill,
    ready_processes,
    receiver_process,
    timed_drain,
)
from outbox.canonical import canonical_bytes
from outbox.schema import messages

Run = dict[str, float]


@dataclass
class Row:
    """One line of the table: ours against the baseline (when there is one), with the target."""

    scenario: str
    backend: str
    unit: str
    ours: float
    baseline: float | None
    ratio: float | None
    target: str
    met: bool | None  # None: reported without a target
    runs: list[Run]
    orders: dict[str, float] | None = None
    """The median ratio with ours run first and with the baseline run first, when both ran."""
    swept: str | None = None
    """The baseline's figure name when it is a sweep's fastest point (benchmarks.sweep)."""


def median_row(
    scenario: str,
    backend: str,
    unit: str,
    runs: list[Run],
    target: str = "",
    met: Callable[[float], bool] | None = None,
    ours: str = "ours",
    baseline: str | None = "baseline",
    ratio: Callable[[Run], float] | None = None,
) -> Row:
    """Medians over the runs of the figures named `ours` and `baseline`.

    The ratio is the median of each run's own ratio (ours / baseline unless
    `ratio` says otherwise); `met` judges it, or judges `ours` when there is no
    baseline.
    """
    per_run = ratio or (lambda run: run[ours] / run[baseline or ""])
    # A ratio to a zero baseline (a share that was none) is undefined: such runs are left
    # out of the ratio, and a target is not met without every run's ratio.
    defined = [] if baseline is None else [r for r in runs if ratio or r[baseline] != 0]
    median_ratio = round(statistics.median(map(per_run, defined)), 2) if defined else None
    ours_median = round(statistics.median(run[ours] for run in runs), 1)
    judged = median_ratio if median_ratio is not None else ours_median
    undefined = baseline is not None and len(defined) < len(runs)
    return Row(
        scenario,
        backend,
        unit,
        ours_median,
        None if baseline is None else round(statistics.median(run[baseline] for run in runs), 1),
        median_ratio,
        target,
        None if met is None else not undefined and met(judged),
        runs,
    )


OURS_FIRST = "ours first"
BASELINE_FIRST = "baseline first"


def ordered_row(
    scenario: str,
    backend: str,
    unit: str,
    runs: list[Run],
    ours_first: tuple[str, str],
    baseline_first: tuple[str, str],
    target: str = "",
    met: Callable[[float], bool] | None = None,
    worse: Callable[[float, float], float] = min,
    swept: str | None = None,
) -> Row:
    """A comparison measured in both orders in each run: (ours, baseline) figure names of the
    pair where ours ran first and of the pair where the baseline ran first.

    Each order's ratio is the median of the runs' own; the row's ratio, which `met`
    judges, is the `worse` of the two (the lower for a rate, `max` for a latency), so
    neither order's luck flatters us. Ours and the baseline are medians over both orders.
    """
    ratios = {
        order: round(statistics.median(run[ours] / run[baseline] for run in runs), 2)
        for order, (ours, baseline) in ((OURS_FIRST, ours_first), (BASELINE_FIRST, baseline_first))
    }
    judged = worse(ratios[OURS_FIRST], ratios[BASELINE_FIRST])
    pairs = (ours_first, baseline_first)
    return Row(
        scenario,
        backend,
        unit,
        round(statistics.median(run[ours] for run in runs for ours, _ in pairs), 1),
        round(statistics.median(run[baseline] for run in runs for _, baseline in pairs), 1),
        judged,
        target,
        None if met is None else met(judged),
        runs,
        ratios,
        swept,
    )


def at_most(limit: float) -> Callable[[float], bool]:
    """A target: the figure is at most `limit`."""
    return lambda value: value <= limit


def at_least(floor: float) -> Callable[[float], bool]:
    """A target: the figure is at least `floor`."""
    return lambda value: value >= floor


def repeat(label: str, runs: int, measure: Callable[[], Run]) -> list[Run]:
    """`measure()` `runs` times, with progress on stderr."""
    results = []
    for n in range(1, runs + 1):
        started = time.monotonic()
        log(f"{label}: run {n}/{runs}")
        results.append(measure())
        log(f"{label}: run {n}/{runs} done in {time.monotonic() - started:.0f} s: {results[-1]}")
    return results


@contextmanager
def sqlite_file(name: str) -> Iterator[str]:
    """A new, migrated SQLite database file (the embedded default), deleted afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / name}"
        outbox.upgrade(url)
        receiver.upgrade(url)
        yield url


# --- publish overhead ---------------------------------------------------------------


def publish_overhead(url: str, transactions: int) -> Run:
    """Microseconds per transaction: publish() against a bare INSERT of the same row."""
    engine = outbox.create_engine(url)
    try:

        def bare(n: int) -> None:
            row = pending_row(f"bare-{n}", canonical_bytes({"n": n}), time.time())
            with Session(engine) as session, session.begin():
                session.execute(sa.insert(messages), row)

        def published(n: int) -> None:
            with Session(engine) as session, session.begin():
                outbox.publish(session, "default", f"pub-{n}", {"n": n})

        timings = {}
        for label, write in (("baseline", bare), ("ours", published)):
            for n in range(-100, 0):  # warm caches and prepared statements
                write(n)
            started = time.perf_counter()
            for n in range(transactions):
                write(n)
            timings[label] = (time.perf_counter() - started) / transactions * 1e6
    finally:
        engine.dispose()
    return timings


def publish_both(transactions: int) -> Run:
    """Publish overhead on PostgreSQL, then on a SQLite file, then on MySQL."""
    with fresh_database() as url:
        pg = publish_overhead(url, transactions)
    with sqlite_file("publish.db") as url:
        lite = publish_overhead(url, transactions)
    with fresh_mysql_database() as url:
        my = publish_overhead(url, transactions)
    return {
        **pg,
        "sqlite_ours": lite["ours"],
        "sqlite_baseline": lite["baseline"],
        "mysql_ours": my["ours"],
        "mysql_baseline": my["baseline"],
    }


def async_publish_overhead(url: str, transactions: int) -> Run:
    """Microseconds per transaction on one AsyncSession (asyncpg): outbox.asyncio.publish
    against a bare INSERT of the same row."""
    return asyncio.run(_async_publish_overhead(url, transactions))


async def _async_publish_overhead(url: str, transactions: int) -> Run:
    engine = create_async_engine(sa.make_url(url).set(drivername="postgresql+asyncpg"))
    try:
        async with AsyncSession(engine) as session:

            async def bare(n: int) -> None:
                # The row publish writes, computed the same way: canonical body, its hash.
                row = pending_row(f"bare-{n}", canonical_bytes({"n": n}), time.time())
                async with session.begin():
                    await session.execute(sa.insert(messages), row)

            async def published(n: int) -> None:
                async with session.begin():
                    await outbox.asyncio.publish(session, "default", f"pub-{n}", {"n": n})

            sides = {"baseline": bare, "ours": published}
            for write in sides.values():
                for n in range(-100, 0):  # warm caches and prepared statements
                    await write(n)
            # In alternating rounds, so a slow spell of a shared machine (a commit's flush
            # takes most of a transaction) hits both sides alike.
            spent = dict.fromkeys(sides, 0.0)
            rounds = 10
            for round_ in range(rounds):
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                for label in order:
                    started = time.perf_counter()
                    for n in range(round_, transactions, rounds):
                        await sides[label](n)
                    spent[label] += time.perf_counter() - started
    finally:
        await engine.dispose()
    return {label: total / transactions * 1e6 for label, total in spent.items()}


def async_publish(transactions: int) -> Run:
    """Async publish overhead on PostgreSQL through asyncpg."""
    with fresh_database() as url:
        return async_publish_overhead(url, transactions)


# --- drain against a naive relay --------------------------------------------------------


def naive_drain(total: int, window: float) -> float:
    """Messages per second the hand-written loop (benchmarks.naive_relay) delivers from a
    prefilled backlog of `total`, timed from its `ready` line over at most `window` seconds."""
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        prefill(url, total)
        with receiver_process(url, Path(tmp), reference_effect=False) as target:
            result = timed_drain(
                url,
                total,
                lambda: ready_processes(("benchmarks.naive_relay", url, target, SECRET)),
                window=window,
            )
    log(f"  naive: {result}")
    if result["rate"] <= 0:
        raise RuntimeError(f"the naive relay delivered nothing: {result}")
    return float(result["rate"])


def complete_rate(result: dict[str, Any]) -> float:
    """The rate of a drain that delivered everything, or RuntimeError."""
    if not result["complete"]:
        raise RuntimeError(f"the relays did not drain: {result}")
    return float(result["rate"])


def sqlite_drain(total: int) -> float:
    """Messages per second two relays deliver from a SQLite file to a receiver on another."""
    with sqlite_file("outbox.db") as url, sqlite_file("receiver.db") as receiver_url:
        prefill(url, total)
        return complete_rate(drain_backlog(url, total, "batch", 2, 1000, 1, receiver_url))


def mysql_drain(total: int) -> float:
    """Messages per second two relays deliver from MySQL to a receiver on the same database."""
    with fresh_mysql_database() as url:
        prefill(url, total)
        return complete_rate(drain_backlog(url, total, "batch", 2, 1000, 1))


def drains(size: Sizes, points: tuple[sweep.Point, ...]) -> Run:
    """Messages per second, each on a fresh prefill of the same size: the bare relays swept
    over `points`; our relays (batch mode, 2 relays), the sweep's winner measured again
    (`bare`), our relays again (`ours_after`), the naive loop (`baseline`), ours once more
    (`ours_last`): each baseline ran right between two drains of ours, so each order gives
    a ratio of two drains back to back. Then ours into the receiver running its reference
    effect (`ours_effect`), and ours on SQLite and on MySQL (a smaller backlog). Every
    other receiver stores receipts only, as the bare receiver does."""
    figures, winner = bare_relay.bare_points(size.drain, points)
    first = bare_relay.ours_drain(size.drain)
    figures |= {"ours": float(first["rate"]), **bare_relay.cpu_parts("ours", first)}
    figures |= bare_relay.bare_at(size.drain, winner)
    figures["ours_after"] = float(bare_relay.ours_drain(size.drain)["rate"])
    figures["baseline"] = naive_drain(size.drain, size.naive_seconds)
    figures["ours_last"] = float(bare_relay.ours_drain(size.drain)["rate"])
    figures["ours_effect"] = complete_rate(
        drain(size.drain, "batch", bare_relay.RELAYS, bare_relay.OURS_BATCH)
    )
    figures["sqlite_ours"] = sqlite_drain(size.sqlite_drain)
    figures["mysql_ours"] = mysql_drain(size.sqlite_drain)
    return figures


DRAIN_PARTS = (
    ("relay", "relay processes"),
    ("relay_db", "the relays' PostgreSQL backends"),
    ("receiver", "receiver process"),
    ("receiver_db", "the receiver's PostgreSQL backends"),
)
"""The parts of a drain whose CPU per message is compared (relay_bench.drain_part)."""

BROKERS = (("nats", "JetStream"), ("rabbitmq", "RabbitMQ"))


def broker_comparisons(quick: bool, points: tuple[sweep.Point, ...]) -> Run:
    """For each broker the bare publishers and the bare relays into it, each swept over
    `points`; the HTTP batch drain; for each broker our drain into it, the bare relays' and
    the bare publishers' winners measured again, our drain again (`<kind>_after`) and the
    consumer taking what it left; the HTTP drain again (`http_after`). Each comparison so
    runs in both orders, each swept baseline between two drains of ours (the relays right
    after ours first, the publishers right before ours after)."""
    total = broker_drain.sizes(quick)
    figures: Run = {}
    won: dict[str, tuple[sweep.Point, sweep.Point]] = {}
    for kind, _ in BROKERS:
        publishers, publishers_won = broker_ceiling.bare_points(kind, total, points)
        relays, relays_won = bare_broker_relay.bare_relay_points(kind, total, points)
        figures |= publishers | relays
        won[kind] = (publishers_won, relays_won)
    figures |= broker_drain.http_drain(total)
    for kind, _ in BROKERS:
        publishers_won, relays_won = won[kind]
        figures |= broker_drain.broker_drain(kind, total, then_consume=False)
        figures |= bare_broker_relay.bare_relay_at(kind, total, relays_won)
        figures |= broker_ceiling.bare_at(kind, total, publishers_won)
        again = broker_drain.broker_drain(kind, total)
        figures[f"{kind}_after"] = again[kind]
        figures[f"{kind}_consume"] = again[f"{kind}_consume"]
    figures["http_after"] = broker_drain.http_drain(total)["http"]
    return figures


# --- live latency -----------------------------------------------------------------------


def live_latency(seconds: float) -> Run:
    """4 producers at their full rate, one relay: commit-to-receipt quantiles and the backlog."""
    result = live(seconds, 4, 1)
    return {
        "p50_ms": result["p50_ms"],
        "p99_ms": result["p99_ms"],
        "rate": float(result["rate"]),
        "backlog_at_stop": float(result["backlog_at_stop"]),
        "backlog_pct": 100 * result["backlog_at_stop"] / max(result["messages"], 1),
    }


# --- ordering keys ------------------------------------------------------------------------

KEYED_LIVE_KEYS = 20
"""Ordering keys of the keyed live run, shared out among its producers (relay_bench.live_key)."""


def keyed_comparisons(size: Sizes) -> Run:
    """Messages per second of each keyed backlog and of the unkeyed ones of its size, drained
    in turn by the same relays (relay_bench.keyed_drains).

    Each keyed batch backlog runs between an unkeyed one of its size (`small`, `large`)
    and another (`small_after`, `large_after`), so each comparison has both orders; then
    one key in single mode. A warm-up backlog through both destinations goes first,
    so no measured one pays for the relays' first claims.
    """
    few_keys, few_each = size.few_keys
    many_keys, many_each = size.many_keys
    large = few_keys * few_each
    if many_keys * many_each != large:
        raise ValueError(f"the keyed backlogs differ in size: {size}")
    results = keyed_drains(
        [
            Backlog("warm", 100, keys=10),
            Backlog("warm_single", 10, keys=2, mode="single"),
            Backlog("small", size.one_key),
            Backlog("one_key", size.one_key, keys=1),
            Backlog("small_after", size.one_key),
            Backlog("large", large),
            Backlog("few_keys", large, keys=few_keys),
            Backlog("many_keys", large, keys=many_keys),
            Backlog("large_after", large),
            Backlog("one_key_single", size.one_key, keys=1, mode="single"),
        ]
    )
    return {
        name: complete_rate(result)
        for name, result in results.items()
        if not name.startswith("warm")
    }


def keyed_rows(size: Sizes, keyed: list[Run], paced: list[Run]) -> list[Row]:
    """The keyed drains against the unkeyed ones of their size, one key in single mode, and
    the keyed live run against the unkeyed ones at the same pace."""
    rows = []
    shapes = (
        ("one key", (1, size.one_key), "one_key", ">= 0.5", 0.5),
        ("few long keys", size.few_keys, "few_keys", ">= 0.8", 0.8),
        ("many short keys", size.many_keys, "many_keys", "", None),
    )
    for label, (keys, each), figure, target, least in shapes:
        baseline = "small" if figure == "one_key" else "large"
        rows.append(
            ordered_row(
                f"keyed drain vs unkeyed, {label} ({keys:,} x {each:,} messages, batch)",
                "postgresql",
                "messages/s",
                keyed,
                (figure, f"{baseline}_after"),
                (figure, baseline),
                target,
                None if least is None else at_least(least),
            )
        )
    rows.append(
        median_row(
            f"keyed drain rate, one key, single mode (1 x {size.one_key:,} messages)",
            "postgresql",
            "messages/s",
            keyed,
            ">= 300",
            at_least(300),
            ours="one_key_single",
            baseline=None,
        )
    )
    load = f"{bare_relay.LIVE_PRODUCERS} x {bare_relay.LIVE_RATE:g}/s, {KEYED_LIVE_KEYS} keys"
    for figure, ceiling in (("p50", 1.5), ("p99", None)):
        rows.append(
            ordered_row(
                f"keyed live {figure} vs unkeyed ({load})",
                "postgresql",
                "ms",
                paced,
                (f"keyed_{figure}_ms", f"ours_after_{figure}_ms"),
                (f"keyed_{figure}_ms", f"ours_{figure}_ms"),
                "" if ceiling is None else f"<= {ceiling:g}",
                None if ceiling is None else at_most(ceiling),
                worse=max,
            )
        )
    return rows


# --- tracing ------------------------------------------------------------------------------


def tracing_rows(tracing: list[Run]) -> list[Row]:
    """Tracing configured and exporting against not configured, in the drain and the paced
    live run; not configured against OpenTelemetry not importable, in the drain
    (benchmarks.trace_cost, each comparison in both orders)."""
    load = f"{bare_relay.LIVE_PRODUCERS} x {bare_relay.LIVE_RATE:g}/s"
    return [
        ordered_row(
            "drain, tracing configured and exporting vs not configured",
            "postgresql",
            "messages/s",
            tracing,
            ("drain_traced", "drain_off"),
            ("drain_traced_after", "drain_off_after"),
            ">= 0.8",
            at_least(0.8),
        ),
        ordered_row(
            "drain, opentelemetry-api installed but no provider vs not importable",
            "postgresql",
            "messages/s",
            tracing,
            ("drain_off", "drain_absent"),
            ("drain_off_after", "drain_absent"),
            ">= 0.95",
            at_least(0.95),
        ),
        ordered_row(
            f"live p50, tracing configured vs not configured ({load})",
            "postgresql",
            "ms",
            tracing,
            ("live_traced_p50_ms", "live_off_p50_ms"),
            ("live_traced_after_p50_ms", "live_off_p50_ms"),
            "<= 1.25",
            at_most(1.25),
            worse=max,
        ),
    ]


# --- the table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much each scenario moves: the issue's sizes, or small ones for --quick."""

    publish_transactions: int
    drain: int
    naive_seconds: float
    """The naive loop's window: it drains the same backlog as ours, too slowly to finish it."""
    sqlite_drain: int
    live_seconds: float
    one_key: int
    """Messages of the one-key backlogs (and of the unkeyed ones they are compared with)."""
    few_keys: tuple[int, int]
    """(keys, messages per key) of the backlog of few long keys."""
    many_keys: tuple[int, int]
    """(keys, messages per key) of the backlog of many short keys: as many messages."""

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        """The sizes for a full or a quick run."""
        if quick:
            return cls(300, 5_000, 2.0, 2_000, 3.0, 50, (10, 20), (100, 2))
        return cls(3_000, 200_000, 60.0, 50_000, 10.0, 2_000, (100, 200), (10_000, 2))


def measure(runs: int, quick: bool) -> list[Row]:
    """Every scenario, `runs` times each; the table's rows."""
    size = Sizes.of(quick)
    rows: list[Row] = []
    publish = repeat("publish overhead", runs, lambda: publish_both(size.publish_transactions))
    rows.append(
        median_row(
            "publish vs bare insert",
            "postgresql",
            "us/transaction",
            publish,
            "<= 1.3",
            lambda r: r <= 1.3,
        )
    )
    asynchronous = repeat(
        "async publish overhead", runs, lambda: async_publish(size.publish_transactions)
    )
    rows.append(
        median_row(
            "async publish vs bare insert (asyncpg)",
            "postgresql",
            "us/transaction",
            asynchronous,
            "<= 1.3",
            lambda r: r <= 1.3,
        )
    )
    points = sweep.grid(quick)
    flows = repeat("drain vs naive and bare relays", runs, lambda: drains(size, points))
    rows.append(
        ordered_row(
            "drain vs naive relay",
            "postgresql",
            "messages/s",
            flows,
            ("ours_after", "baseline"),
            ("ours_last", "baseline"),
            ">= 20x",
            lambda r: r >= 20,
        )
    )
    # Every drain of ours counts, whichever side of a baseline it ran on.
    ours_drains = [
        {"ours": run[name]} for run in flows for name in ("ours", "ours_after", "ours_last")
    ]
    rows.append(
        median_row(
            "drain rate",
            "postgresql",
            "messages/s",
            ours_drains,
            ">= 30,000",
            lambda r: r >= 30_000,
            baseline=None,
        )
    )
    rows.append(
        ordered_row(
            "drain vs bare relay (the sweep's fastest point, measured again; "
            f"won: {sweep.winners('bare', flows)})",
            "postgresql",
            "messages/s",
            flows,
            ("ours", "bare"),
            ("ours_after", "bare"),
            ">= 0.8",
            lambda r: r >= 0.8,
            swept="bare",
        )
    )
    for part, label in DRAIN_PARTS:
        rows.append(
            median_row(
                f"CPU per message in the drain, {label}: ours vs the bare relay's best point",
                "postgresql",
                "CPU us/message",
                flows,
                ours=f"ours_cpu_us_{part}",
                baseline=f"bare_cpu_us_{part}",
            )
        )
    rows.append(
        median_row(
            "drain into the receiver with its reference effect vs receipts only",
            "postgresql",
            "messages/s",
            flows,
            ours="ours_effect",
            ratio=lambda run: run["ours_effect"] / run["ours_last"],
            baseline="ours_last",
        )
    )
    brokers = repeat("broker drains", runs, lambda: broker_comparisons(quick, points))
    for kind, name in BROKERS:
        won = sweep.winners(f"{kind}_bare_relay", brokers)
        rows.append(
            ordered_row(
                f"drain into {name} vs bare relays into {name} "
                f"(the sweep's fastest point, measured again; won: {won})",
                "postgresql",
                "messages/s",
                brokers,
                (kind, f"{kind}_bare_relay"),
                (f"{kind}_after", f"{kind}_bare_relay"),
                ">= 0.8",
                lambda r: r >= 0.8,
                swept=f"{kind}_bare_relay",
            )
        )
    for kind, name in BROKERS:
        rows.append(
            ordered_row(
                f"drain into {name} vs HTTP batch",
                "postgresql",
                "messages/s",
                brokers,
                (f"{kind}_after", "http_after"),
                (kind, "http"),
            )
        )
    for kind, name in BROKERS:
        rows.append(
            median_row(
                f"machine CPU per message, {name} vs HTTP batch drain",
                "postgresql",
                "CPU us/message",
                brokers,
                ours=f"{kind}_cpu_us",
                baseline="http_cpu_us",
            )
        )
        won = sweep.winners(f"{kind}_bare", brokers)
        rows.append(
            ordered_row(
                f"drain into {name} vs bare publishers into {name} "
                f"(no database; the sweep's fastest point, measured again; won: {won})",
                "postgresql",
                "messages/s",
                brokers,
                (kind, f"{kind}_bare"),
                (f"{kind}_after", f"{kind}_bare"),
                swept=f"{kind}_bare",
            )
        )
        rows.append(
            median_row(
                f"{name} server's own CPU per message",
                "postgresql",
                "CPU us/message",
                brokers,
                ours=f"{kind}_server_cpu_us",
                baseline=None,
            )
        )
    for kind, name in BROKERS:
        rows.append(
            median_row(
                f"consume from {name}",
                "postgresql",
                "messages/s",
                brokers,
                ours=f"{kind}_consume",
                baseline=None,
            )
        )
    latency = repeat("live latency", runs, lambda: live_latency(size.live_seconds))
    for scenario, figure, unit, limit, target in (
        ("live commit-to-receipt p50", "p50_ms", "ms", 10, "<= 10 ms"),
        ("live commit-to-receipt p99", "p99_ms", "ms", 50, "<= 50 ms"),
        ("live backlog at stop", "backlog_pct", "% of sent", 1, "<= 1% (flat)"),
    ):
        rows.append(
            median_row(
                scenario,
                "postgresql",
                unit,
                latency,
                target,
                at_most(limit),
                ours=figure,
                baseline=None,
            )
        )
    paced = repeat(
        "live vs bare relay and keyed",
        runs,
        lambda: bare_relay.live_pair(size.live_seconds, keys=KEYED_LIVE_KEYS),
    )
    load = f"{bare_relay.LIVE_PRODUCERS} x {bare_relay.LIVE_RATE:g}/s"
    for figure, ceiling in (("p50", 1.5), ("p99", 2.0)):
        rows.append(
            ordered_row(
                f"live {figure} vs bare relay ({load})",
                "postgresql",
                "ms",
                paced,
                (f"ours_{figure}_ms", f"bare_{figure}_ms"),
                (f"ours_after_{figure}_ms", f"bare_{figure}_ms"),
                f"<= {ceiling:g}",
                at_most(ceiling),
                worse=max,
            )
        )
    rows.append(
        median_row(
            f"live producers' rate, ours vs bare relay runs ({load})",
            "postgresql",
            "commits/s",
            paced,
            ours="ours_producer_rate",
            baseline="bare_producer_rate",
        )
    )
    keyed = repeat("keyed drains", runs, lambda: keyed_comparisons(size))
    rows += keyed_rows(size, keyed, paced)
    tracing = repeat(
        "tracing cost", runs, lambda: trace_cost.measure(size.drain, size.live_seconds)
    )
    rows += tracing_rows(tracing)
    task_throughput.require_pgqueuer()  # a missing baseline is an error, not a skip
    throughput = repeat("task throughput", runs, lambda: task_throughput.run(quick))
    for scenario, ours in (
        ("tasks vs PGQueuer, thread handlers", "ours"),
        ("tasks vs PGQueuer, async handlers", "ours_async"),
    ):
        rows.append(
            median_row(
                scenario,
                "postgresql",
                "tasks/s",
                throughput,
                ">= 1.0",
                lambda r: r >= 1.0,
                ours=ours,
            )
        )
    waits = repeat("worker waits", runs, lambda: worker_waits.run(quick))
    rows.append(
        median_row(
            "async worker x500, 100 ms waits vs no-op",
            "postgresql",
            "tasks/s",
            waits,
            ours="async_wait",
        )
    )
    # Judged against the most 500 slots waiting 100 ms each can do (5,000 tasks/s), which
    # lies below the no-op rate: against no-op the waits themselves would be the shortfall.
    rows.append(
        median_row(
            "async worker x500, 100 ms waits vs 500 / 0.1 s",
            "postgresql",
            "tasks/s",
            waits,
            ">= 0.9",
            lambda r: r >= 0.9,
            ours="async_wait",
            baseline="slot_bound",
        )
    )
    rows.append(
        median_row(
            "threads x500, 100 ms waits vs async no-op",
            "postgresql",
            "tasks/s",
            waits,
            ours="thread_wait",
        )
    )
    for scenario, figure, target in (
        ("task wake-up p50, NOTIFY", "notify_p50_ms", "<= 10 ms"),
        ("task wake-up p90, NOTIFY", "notify_p90_ms", ""),
        ("task wake-up p50, polling every 0.5 s", "poll_p50_ms", ""),
    ):
        rows.append(
            median_row(
                scenario,
                "postgresql",
                "ms",
                waits,
                target,
                at_most(10) if target else None,
                ours=figure,
                baseline=None,
            )
        )
    growth = repeat("cost growth", runs, lambda: cost_growth.run(quick))
    history = f"{int(growth[0]['history_rows']):,}"
    rows.append(
        median_row(
            f"claim latency with history ({history} rows)",
            "postgresql",
            "us/claim",
            growth,
            "<= 1.2",
            lambda r: r <= 1.2,
            ours="claim_us_history",
            baseline="claim_us_empty",
        )
    )
    rows.append(
        median_row(
            f"drain slowdown with history ({history} rows)",
            "postgresql",
            "messages/s",
            growth,
            "<= 1.2",
            lambda r: r <= 1.2,
            ours="drain_rate_history",
            baseline="drain_rate_empty",
            ratio=lambda run: run["drain_rate_empty"] / run["drain_rate_history"],
        )
    )
    rows.append(
        median_row(
            f"relay peak RSS draining ({cost_growth.sizes(quick)[2]:,} rows)",
            "postgresql",
            "MB",
            growth,
            "< 150 MB",
            lambda r: r < 150,
            ours="relay_rss_mb",
            baseline=None,
        )
    )
    pages = repeat("console pages", runs, lambda: console_pages.run(quick))
    large = repeat("console overview, large", runs, lambda: console_pages.run_large(quick))
    rows += console_rows(pages, large, quick)
    receiving = repeat("receiver CPU", runs, lambda: receiver_cpu.run(quick))
    rows.append(
        median_row(
            "receiver CPU per stored reply, batches of 1,000",
            "postgresql",
            "CPU us/reply",
            receiving,
            ours="receiver_cpu_us_per_reply",
            baseline=None,
        )
    )
    cost = repeat("database cost", runs, lambda: database_cost(quick))
    for scenario, unit, figure in DB_COST_ROWS:
        rows.append(
            median_row(scenario, "postgresql", unit, cost, ours=figure, baseline=BEFORE + figure)
        )
    # SQLite, the embedded default: its baseline is our PostgreSQL figure of the same run.
    rows.append(
        median_row(
            "drain vs PostgreSQL",
            "sqlite",
            "messages/s",
            flows,
            ours="sqlite_ours",
            baseline="ours",
        )
    )
    rows.append(
        median_row(
            "tasks vs PostgreSQL", "sqlite", "tasks/s", throughput, ours="sqlite", baseline="ours"
        )
    )
    rows.append(
        median_row(
            "publish vs bare insert",
            "sqlite",
            "us/transaction",
            publish,
            ours="sqlite_ours",
            baseline="sqlite_baseline",
        )
    )
    rows += mysql_rows(publish, flows, throughput, growth)
    return rows


def console_rows(pages: list[Run], large: list[Run], quick: bool) -> list[Row]:
    """The console's rows: its slowest page and first answer with a long history, the
    overview over a longer one, a bulk requeue (benchmarks.console_pages)."""
    history_rows, dead_replies = console_pages.sizes(quick)
    ms = at_most(console_pages.TARGET_MS)
    return [
        median_row(
            f"console slowest page ({history_rows:,} rows, {dead_replies:,} dead)",
            "postgresql", "ms", pages, "<= 200 ms", ms, ours="slowest_ms", baseline=None,
        ),
        median_row(
            f"console slowest first answer after start ({history_rows:,} rows)",
            "postgresql", "ms", pages, "<= 200 ms", ms, ours="slowest_first_ms", baseline=None,
        ),
        median_row(
            f"console overview ({console_pages.large_size(quick):,} rows of history)",
            "postgresql", "ms", large, "<= 200 ms", ms, ours="overview_median_ms",
            baseline=None,
        ),
        median_row(
            f"console bulk requeue ({dead_replies:,} dead replies)",
            "postgresql", "s", pages, "<= 10 s", at_most(console_pages.BULK_TARGET_S),
            ours="bulk_requeue_s", baseline=None,
        ),
    ]  # fmt: skip


def mysql_rows(
    publish: list[Run], flows: list[Run], throughput: list[Run], growth: list[Run]
) -> list[Row]:
    """MySQL's rows (MariaDB here): publish against a bare insert, claim latency and drain
    with history against none, with targets; drain and tasks against PostgreSQL's figure
    of the same run, without."""
    history = f"{int(growth[0]['history_rows']):,}"
    return [
        median_row(
            "publish vs bare insert",
            "mysql",
            "us/transaction",
            publish,
            "<= 1.3",
            lambda r: r <= 1.3,
            ours="mysql_ours",
            baseline="mysql_baseline",
        ),
        median_row(
            f"claim latency with history ({history} rows)",
            "mysql",
            "us/claim",
            growth,
            "<= 1.2",
            lambda r: r <= 1.2,
            ours="mysql_claim_us_history",
            baseline="mysql_claim_us_empty",
        ),
        median_row(
            f"drain slowdown with history ({history} rows)",
            "mysql",
            "messages/s",
            growth,
            "<= 1.2",
            lambda r: r <= 1.2,
            ours="mysql_drain_rate_history",
            baseline="mysql_drain_rate_empty",
            ratio=lambda run: run["mysql_drain_rate_empty"] / run["mysql_drain_rate_history"],
        ),
        median_row(
            "drain vs PostgreSQL", "mysql", "messages/s", flows, ours="mysql_ours", baseline="ours"
        ),
        median_row(
            "tasks vs PostgreSQL", "mysql", "tasks/s", throughput, ours="mysql", baseline="ours"
        ),
    ]


BEFORE = "before."


def database_cost(quick: bool) -> Run:
    """benchmarks.db_cost on today's storage, then (figures prefixed BEFORE) on the storage
    before the migrations made for them."""
    now = db_cost.run(quick)
    before = db_cost.run(quick, db_cost.BEFORE_STORAGE)
    return now | {BEFORE + key: value for key, value in before.items()}


# (scenario, unit, figure of benchmarks.db_cost): reported without targets for now.
DB_COST_ROWS = (
    (
        "WAL per delivered message (outbox database, without full-page images)",
        "WAL bytes/message",
        "message_outbox_wal_bytes",
    ),
    (
        "full-page images per delivered message (after a checkpoint)",
        "FPI bytes/message",
        "message_outbox_fpi_bytes",
    ),
    (
        "index entries per delivered message (outbox database)",
        "entries/message",
        "message_outbox_index_entries",
    ),
    (
        "HOT share of message updates (claim, settle)",
        "HOT % of updates",
        "message_outbox.outbox_messages.hot_pct",
    ),
    (
        "receiver WAL per delivered message (its own database)",
        "WAL bytes/message",
        "message_receiver_wal_bytes",
    ),
    (
        "WAL per finished task (claim, finish, reply; without full-page images)",
        "WAL bytes/task",
        "task_outbox_wal_bytes",
    ),
    (
        "full-page images per finished task (after a checkpoint)",
        "FPI bytes/task",
        "task_outbox_fpi_bytes",
    ),
    ("index entries per finished task", "entries/task", "task_outbox_index_entries"),
    (
        "HOT share of task updates (claim, finish)",
        "HOT % of updates",
        "task_outbox.outbox_tasks.hot_pct",
    ),
    (
        "WAL per lease renewal (without full-page images)",
        "WAL bytes/renewal",
        "renewal_outbox_wal_bytes",
    ),
    ("HOT share of lease renewals", "HOT % of updates", "renewal_outbox.outbox_tasks.hot_pct"),
)


def cell(value: float | None, digits: int = 1) -> str:
    """A number for the table, or a dash."""
    return "-" if value is None else f"{value:,.{digits}f}"


def verdict(row: Row) -> str:
    """yes, NO, or a dash when the row is reported without a target."""
    return "-" if row.met is None else ("yes" if row.met else "NO")


def by_order(row: Row) -> str:
    """Each order's ratio, or a dash when the row was measured in one order."""
    if row.orders is None:
        return "-"
    return "; ".join(f"{order} {ratio:,.2f}" for order, ratio in row.orders.items())


def render(rows: list[Row]) -> str:
    """The results as a plain-text table."""
    lines = [
        f"{'scenario':<46} {'backend':<10} {'unit':<14} {'ours':>10} {'baseline':>10} "
        f"{'ratio':>7}  {'ratio by order':<36} {'target':<20} met"
    ]
    for row in rows:
        lines.append(
            f"{row.scenario:<46} {row.backend:<10} {row.unit:<14} {cell(row.ours):>10} "
            f"{cell(row.baseline):>10} {cell(row.ratio, 2):>7}  {by_order(row):<36} "
            f"{row.target or '-':<20} {verdict(row)}"
        )
    return "\n".join(lines)


def sweep_lines(rows: list[Row]) -> list[str]:
    """For each row whose baseline is a sweep's fastest point, every point's median rate."""
    lines = []
    for row in rows:
        if row.swept is None:
            continue
        medians = sweep.medians(row.swept, row.runs)
        points = ", ".join(f"{label} {rate:,.0f}" for label, rate in medians.items())
        lines.append(f"- {row.scenario.split(' (')[0]}: {points} ({row.unit}).")
    return lines


def markdown(rows: list[Row], document: dict[str, Any]) -> str:
    """docs/explanation/performance.md: the table of one run, with its command, date and machine."""
    lines = [
        "# Performance",
        "",
        "Written by the benchmark suite from one real run; do not edit by hand.",
        "",
        f"- command: `{document['command']}`",
        f"- date: {document['date']}",
        f"- machine: {document['machine']}",
        f"- runs per scenario: {document['runs']} (medians; each ratio is the median of the "
        "runs' own ratios, ours and baseline measured back to back)",
        "- order: where a row gives a ratio by order, each run measured the baseline (a "
        "swept one: its winner measured again, its points before) between two measurements "
        "of ours; `ours first` pairs the baseline with the one of ours before it, `baseline "
        "first` with the one after it, and the row's ratio, the one judged, is the less "
        "favourable of the two",
        "",
        "| scenario | backend | unit | ours | baseline | ratio | ratio by order | target | met |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.scenario} | {row.backend} | {row.unit} | {cell(row.ours)} | "
            f"{cell(row.baseline)} | {cell(row.ratio, 2)} | {by_order(row)} | "
            f"{row.target or '-'} | {verdict(row)} |"
        )
    lines += ["", "Sweeps (batch or parcel size x in flight: median rate of each point's "]
    lines[-1] += "first measurement; each run's fastest point, measured again, gives the "
    lines[-1] += "baseline of its row):"
    lines += ["", *sweep_lines(rows)]
    lines += ["", "Baselines:", ""]
    lines += [f"- {text}" for text in BASELINES]
    for key, title, command, what in PROFILES:
        if document.get(key):
            lines += [
                "",
                f"## {title}",
                "",
                f"A target was missed; `{command}` in the same run: {what}, sampled by py-spy "
                "(the thread holding the interpreter lock, inclusive shares).",
                "",
                "```",
                document[key],
                "```",
            ]
    return "\n".join(lines) + "\n"


PROFILE_TASKS = 20_000
PROFILE_MESSAGES = 200_000
PROFILES = (
    (
        "worker_profile",
        "Where a Worker's time goes",
        f"python -m benchmarks.profiles worker --tasks {PROFILE_TASKS}",
        f"one Worker process draining {PROFILE_TASKS:,} no-op tasks",
    ),
    (
        "drain_profile",
        "Where a drain's time goes",
        f"python -m benchmarks.profiles drain --messages {PROFILE_MESSAGES}",
        f"a relay and the receiver for {profiles.DRAIN_SAMPLE_SECONDS} s in the middle of a "
        f"drain of {PROFILE_MESSAGES:,} replies by two relays",
    ),
    *(
        (
            f"{kind}_profile",
            f"Where a drain into {name}'s time goes",
            f"python -m benchmarks.profiles {kind} --messages {PROFILE_MESSAGES}",
            f"a relay for {profiles.DRAIN_SAMPLE_SECONDS} s in the middle of a drain of "
            f"{PROFILE_MESSAGES:,} replies by two relays into {name}",
        )
        for kind, name in (("nats", "JetStream"), ("rabbitmq", "RabbitMQ"))
    ),
)


BASELINES = (
    "publish: a bare INSERT of the same row through the same SQLAlchemy session.",
    "async publish: a bare INSERT of the same row through the same AsyncSession (asyncpg), "
    "one transaction each.",
    "drain: ours is 2 relays in batch mode (claims of 1,000, destination concurrency 8) "
    "into the reference receiver storing receipts only (benchmarks/receipts_receiver.py: "
    "`outbox receiver`'s application, checks and receipt store, without the reference "
    "effect's second row, which the bare and naive relays' receivers do not write either), "
    "on a prefilled backlog of the full size, a CHECKPOINT before each drain (so every "
    "drain starts at the same point of the server's checkpoint cycle), timed from every "
    "relay answering its readiness check (its loop delivering, the receivers' retention "
    "checked) to the last message sent. The naive relay "
    "(benchmarks/naive_relay.py: one row per transaction, one POST per message on a new "
    "connection, 1 s polling) drains a fresh prefill of the same size, timed the same way from "
    "its `ready` line (so its interpreter's start is not counted) over a window of 60 s (2 s "
    "in a quick run): at under 300 per second it would take over 11 minutes to finish, "
    "and its rate does not fall as "
    "the backlog shrinks. In each run the bare relays' sweep comes first; then ours drains, "
    "the sweep's winner again, ours, the naive relay, ours once more, each on a fresh "
    "prefill, so each baseline sits between two drains of ours and both orders give a ratio "
    "of drains run back to back; "
    "then once more into the receiver running its reference effect (a row with a copy of the "
    "body per first receipt, in the receipt's statement), against the drain before it. "
    "CPU per message by part (ours' first drain against the winning point's second drain): "
    "CPU time over the timed window of the relay processes, of the receiver process, and of "
    "the PostgreSQL backends serving each (a backend belongs to the process holding its "
    "client socket), divided by the messages sent in it (benchmarks/cpu.py "
    "part_cpu_seconds).",
    "broker drains: the same 2 relays (same batch settings) into a JetStream stream of the "
    "run's own (PubAck per message) and into a RabbitMQ topic exchange with publisher "
    "confirms and one durable queue bound to it (benchmarks/broker_drain.py). Each run: the "
    "bare publishers' and bare relays' sweeps of each broker; the HTTP batch drain; then for "
    "each broker our drain into it, the bare relays' and the bare publishers' fastest points "
    "measured again, our drain into it again (and the consumer); then the HTTP batch drain "
    "again, each on a fresh prefill of the same backlog, so each comparison has a ratio with "
    "ours first and one with the baseline first; against the bare relays and publishers, "
    "each from drains at most one apart. "
    "The consume rows: one `outbox receiver consume` process (default batch) taking what the "
    "second drain left in the broker into the receiver's tables with the reference effect, "
    "timed from its metrics answering to the last message stored; reported without a target. "
    "CPU per message (the first drains): busy CPU time of the whole machine (all processes: "
    "relays, PostgreSQL, receiver or broker) over the timed window, divided by the messages "
    "sent in it; the server rows are the broker process's own share of it (nats-server, "
    "RabbitMQ's beam.smp). Bare publishers into the same broker "
    "(benchmarks/broker_ceiling.py): as many processes as relays publishing the same bodies "
    "through the same client library with the same acknowledgement (PubAck with "
    "Nats-Msg-Id; confirmed persistent mandatory messages), and nothing else: no database, "
    "no signature or other headers. Each process sends parcels whose acknowledgements it "
    "awaits together, several parcels in flight, timed from every process connected to the "
    "last acknowledgement; the run sweeps parcel size (500, 1,000) by "
    "parcels in flight (1, 4, 8), and the fastest point, measured once more on a fresh "
    "stream or exchange of its own, is the ceiling (its row names the winning point; "
    "every point is listed under Sweeps). No target: the ratio is the share of "
    "the client library's reach that delivery from the database with its guarantees keeps. "
    "Bare relays into the same broker (benchmarks/bare_broker_relay.py), the ceiling the "
    "broker drains are judged against (>= 0.8): as many processes as relays, each claiming "
    "a batch of pending, due rows FOR UPDATE SKIP LOCKED in psycopg directly, publishing "
    "them through the bare publishers' code with the same acknowledgements, awaited "
    "together, then one UPDATE marking them sent and a commit; N batches in flight as N "
    "such loops, each with its own connection; timed from every process's `ready` line on a "
    "fresh prefill and stream or exchange; swept over the same points, the fastest "
    "measured again and kept. "
    "The rows against the HTTP batch drain have no target now: a broker and HTTP do "
    "different work on this machine's two cores.",
    "live: 4 producer processes committing one row per transaction at their full rate, one "
    "relay, into the reference receiver with its effect; timestamps from the databases "
    "(commit to receipt).",
    "bare relay (benchmarks/bare_relay.py, the ceiling): psycopg directly, in one transaction "
    "a claim of a batch of pending, due rows FOR UPDATE SKIP LOCKED, one plain JSON POST of "
    "{reply_id, body} items on a keep-alive httpx client, then one UPDATE marking them sent "
    "and a commit; with N batches in flight, N such loops on threads of the process, each with "
    "its own connection; woken by the same NOTIFY as ours (50 ms polling besides). Its "
    "receiver (benchmarks/bare_receiver.py) is a raw ASGI callable under uvicorn inserting "
    "each batch into its own bare_receipts table with one ON CONFLICT DO NOTHING statement, "
    "receipt time from the database as ours. No signature, fence, lease, strict JSON or "
    "per-item answers. Drain: as many bare relays as ours, each setting on a fresh prefill of "
    "the same size, timed the same way; the run sweeps batch size (500, 1,000) by batches in "
    "flight (1, 4, 8), and the fastest point, measured once more on a fresh prefill, is "
    "the ceiling (its row names the winning point; every point is listed under Sweeps). "
    "Measured again because where points run close the fastest of six noisy figures is the "
    "luckiest draw, which would flatter the ceiling: the sweep chooses the point, a "
    "measurement of its own gives the figure, taken right between our two drains (the "
    "sweep's points first), so each ratio compares drains run back to back. Live: the same "
    "4 producer processes paced at the "
    "same fixed rate (about half what they reach unpaced here), one of our relays (into the "
    "receiver storing receipts only, as in the drain), then one "
    "bare relay (batches of 500, one in flight: a few messages wait at a time), then ours "
    "again, commit-to-receipt from the databases' timestamps; the latency ratio judged is the "
    "higher of the two orders'. The producers' row gives the commit rate each run reached "
    "(same load: ratio near 1).",
    "keyed drains (benchmarks/relay_bench.py keyed_drains): one database, the reference "
    "receiver and 2 relays (claims of 1,000, destination concurrency 8) with two destinations, "
    "one in batch mode and one in single mode, started once for all of a run's backlogs; each "
    "backlog is committed in one transaction while the relays idle and timed from that commit "
    "to the latest sent_at of its messages (one clock: the host's, which the database reads). "
    "In a backlog over k keys message n carries key n mod k, so the keys interleave in commit "
    "order. Each run: a warm-up backlog (not reported); unkeyed 2,000, one key x 2,000, "
    "unkeyed 2,000 again; unkeyed 20,000, 100 keys x 200, 10,000 keys x 2, unkeyed 20,000 "
    "again, all in batch mode, so each keyed backlog has an unkeyed one of its size drained "
    "just before it and one after it (the ratio judged is the less favourable order's); then "
    "one key x 2,000 in single mode, whose rate has an absolute target. The batch "
    "destination has benchmarks.relay_bench.KEYED_SETTINGS (none yet). Keyed live: in the "
    "paced live runs (4 producers at 50 commits/s, one relay), between the bare relay and "
    "ours again, ours with every message carrying one of 20 ordering keys, each producer "
    "cycling through its own 5 (a key's messages 100 ms apart), against our unkeyed runs "
    "before and after it; commit-to-receipt p50 and p99, the higher of the two orders' "
    "ratios judged.",
    "tracing (benchmarks/trace_cost.py): the drain of ours (2 relays, batch mode, the "
    "receiver storing receipts only) on a fresh prefill of the full size whose every message "
    "carries a creation context of its own (a traceparent, as published inside a traced "
    "request), and the paced live run (the same producers at the same pace, one relay), "
    "with the relay and receiver processes started three ways: configured and exporting "
    "(under `opentelemetry-instrument` with OTEL_TRACES_EXPORTER=otlp over http/protobuf to "
    "a local sink in the benchmark's process that answers 200 and counts what it takes, "
    "the SDK's default batch span processor, metrics and logs not exported; a run that "
    "exported nothing fails), not configured (opentelemetry-api installed, no tracer "
    "provider: as every other row runs), and not importable (`opentelemetry` blocked in "
    "those processes by a sitecustomize, as in an install without the `otel` extra). A "
    "process started each way is first asked what the toolkit sees. Each run: drains "
    "exporting, not configured, not importable, not configured, exporting; then live "
    "exporting, not configured, exporting; each comparison so has a pair in each order, "
    "the less favourable judged. Every traced drain and live run's export requests and "
    "bytes are in the row's runs.",
    "tasks: PGQueuer (the `bench` extra) draining as many no-op jobs (its entrypoint an "
    "`async def`) with its own dequeue and completion, in as many processes, each taking "
    "batches of 10; ours, 2 Worker processes at concurrency 10 (and 5 claimed ahead), with a "
    "no-op plain handler on threads, then with a no-op `async def`, commits each result with "
    "its reply row.",
    "worker waits: one Worker process (lease 30 s, as `outbox worker`) draining a prefilled "
    "backlog, timed from the first task taken to the last finished; the baseline is the same "
    "async worker at concurrency 500 with no-op `async def` handlers, this machine's "
    "claim-and-finish limit. 500 slots of 100 ms finish at most 5,000 tasks/s (each slot's "
    "turn also holds its claim and its commit), so the ratio is at most 5,000 / the no-op "
    "rate; the row against 500 / 0.1 s gives the share of that bound reached. The thread "
    "worker runs 500 handler threads on the same 100 ms waits (`time.sleep`), reported "
    "without a target.",
    "task wake-up: one idle Worker process (a plain handler, poll interval 5 s); tasks are "
    "received one at a time (committed), each once the previous one has started, timed from "
    "the commit to the handler's start. No baseline: the target is absolute, and a polling "
    "worker's wait is set by its interval, not by the machine; the polling row (LISTEN off, "
    "0.5 s) shows what the NOTIFY replaces.",
    "cost growth: the same database with no history, then with finished tasks and sent "
    "replies; the relay's memory is its peak RSS (VmHWM) while draining.",
    "receiver CPU (benchmarks/receiver_cpu.py): one `outbox receiver` process taking signed "
    "batch POSTs of 1,000 replies packed as the relay packs them; its own CPU time over the "
    "timed batches per reply stored. No baseline can run in the same run (it was the "
    "receiver before its strict-JSON fast path and leaner storage: 13.2 us per reply "
    "against 5.9 after, measured back to back on one machine).",
    "database cost (benchmarks/db_cost.py): WAL records and full-page images attributed to "
    "the benchmark's own databases by reading the window's WAL back (pg_walinspect), after a "
    "CHECKPOINT, and B-tree entries written, per message a 2-relay drain delivered (receipts "
    "in a database of their own), per task 2 Workers finished (with its reply) and per lease "
    "renewal; HOT shares from pg_stat_user_tables. The baseline is the same run on the storage "
    "before the migrations made for these figures, set up on the fresh databases "
    "(db_cost.BEFORE_STORAGE): no room left on outbox_messages (o0009) and outbox_tasks "
    "pages, and lease_until indexed (o0011). The console's indexes (o0010) are in both. No "
    "target yet.",
    "console pages (benchmarks/console_pages.py): a real `outbox console` process over "
    "sent replies and finished tasks spread over the last day and dead replies (each with "
    "five failed attempts), as many decisions of each kind (requeues, task cancels) and "
    "a day of the relays' backlog samples, every page (overview, lists, a reply, a task, "
    "search, the audit of both kinds and of tasks) asked for 10 times over HTTP with the "
    "token after a warm-up request; the row is the "
    "slowest page's median, every page's median and slowest answer are in the row's runs. "
    "The first-answer row is the slowest of each page's first request, the overview's "
    "being the first the console answers after it starts. The bulk requeue row: every dead "
    "reply of that database requeued by outbox.decisions as the console's confirmed bulk "
    "requeue does (200 to a transaction), the destinations' receipt lookups answered in "
    "the process. The large overview row: the overview alone over 10,000,000 rows of "
    "history (5,000,000 each of sent replies and finished tasks), whose final states' "
    "counts come from PostgreSQL's statistics past 200,000 rows of a table (pages."
    "ESTIMATE_OVER), marked as estimates on the page. No baseline: the targets are "
    "absolute.",
    "sqlite rows: our figure on SQLite files against our PostgreSQL figure of the same run.",
    "mysql rows: MariaDB 10.11 (benchmarks/databases.py; MySQL 8 is not run here) with its "
    "default settings: publish against a bare INSERT of the same row through the same "
    "session, as on PostgreSQL; claim latency and drain with history against none, as the "
    "cost growth rows (the history built by MariaDB's sequence engine); the drain (2 relays, "
    "batch mode, of the SQLite drain's size, the receiver's receipts in the same database) "
    "and tasks (as ours on PostgreSQL, thread handlers) against our PostgreSQL figure of "
    "the same run, without a target.",
)


def machine() -> str:
    """CPU count and model, for the reader of the results."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs, {model}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios, print the table, write the JSON (and the markdown, when asked)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "last-run.json"))
    parser.add_argument("--doc", help="also write the results as markdown here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    started = time.monotonic()
    rows = measure(args.runs, args.quick)
    table = render(rows)
    print(table)
    if args.quick:
        print("(--quick: sizes too small to judge the targets)")
    document: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m benchmarks.suite", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "quick": args.quick,
        "runs": args.runs,
        "seconds": round(time.monotonic() - started),
        "rows": [asdict(row) for row in rows],
    }
    Path(args.json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {args.json} after {document['seconds']} s")
    if args.doc:
        missed = {row.scenario for row in rows if row.met is False}
        if not args.quick and any(row.startswith("tasks vs PGQueuer") for row in missed):
            log("task throughput missed its target: profiling one Worker")
            document["worker_profile"] = profiles.worker(PROFILE_TASKS)
        drain_rows = ("drain rate", "drain vs naive relay", "drain vs bare relay ")
        if not args.quick and any(row.startswith(drain_rows) for row in missed):
            log("the drain missed its target: profiling a relay and the receiver")
            document["drain_profile"] = profiles.drain(PROFILE_MESSAGES)
        for kind, name in (("nats", "JetStream"), ("rabbitmq", "RabbitMQ")):
            # The broker rows' targets are against bare relays into the same broker.
            broker_row = f"drain into {name} vs bare relays into {name} "
            if not args.quick and any(row.startswith(broker_row) for row in missed):
                log(f"the drain into {name} missed its target: profiling a relay")
                document[f"{kind}_profile"] = profiles.broker(kind, PROFILE_MESSAGES)
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        Path(args.doc).write_text(markdown(rows, document), encoding="utf-8")
        log(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
