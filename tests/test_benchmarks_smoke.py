"""The benchmark suite's --quick form runs end to end (a smoke test: no targets asserted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from benchmarks import sweep
from benchmarks.suite import DRAIN_PARTS

ROOT = Path(__file__).resolve().parent.parent
SUITE_DEADLINE = 1_200
"""Seconds for the whole quick suite: minutes of real drains, more on a busy machine."""


# Minutes of CPU on both cores: it runs in `make test-long`, a later step of .ci/run.
@pytest.mark.long
@pytest.mark.timeout(SUITE_DEADLINE + 120)
def test_quick_suite_runs_and_writes_its_table(pg_server: sa.Engine, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    admin_url = pg_server.url.set(drivername="postgresql+psycopg")
    # Its own process group: on a timeout the relays, receivers and consoles the suite
    # started are killed with it, not left running into the next tests.
    suite = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.suite", "--quick", "--runs", "1", "--json", str(out)],
        cwd=ROOT,
        env={
            **os.environ,
            "OUTBOXDEV_BENCH_PG_URL": admin_url.render_as_string(hide_password=False),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = suite.communicate(timeout=SUITE_DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(suite.pid, signal.SIGKILL)
        _, stderr = suite.communicate()
        raise AssertionError(
            f"the quick suite ran over {SUITE_DEADLINE} s:\n{stderr[-4000:]}"
        ) from None
    except BaseException:  # an interrupt: what the suite started must not outlive the run
        os.killpg(suite.pid, signal.SIGKILL)
        suite.communicate()
        raise
    assert suite.returncode == 0, stderr
    check_results(json.loads(out.read_text(encoding="utf-8")), stdout)


def in_parts(row: dict[str, Any]) -> bool:
    """Whether a row compares one part's CPU per message in the drain."""
    return str(row["scenario"]).startswith("CPU per message in the drain, ")


def check_results(document: dict[str, Any], table: str) -> None:
    """What a quick run's JSON and printed table must hold: every row, with sane figures."""
    rows = {(row["scenario"].split(" (")[0], row["backend"]): row for row in document["rows"]}
    assert set(rows) == {
        ("publish vs bare insert", "postgresql"),
        ("async publish vs bare insert", "postgresql"),
        ("drain vs naive relay", "postgresql"),
        ("drain rate", "postgresql"),
        ("drain vs bare relay", "postgresql"),
        ("drain into the receiver with its reference effect vs receipts only", "postgresql"),
        *(
            (
                f"CPU per message in the drain, {label}: ours vs the bare relay's best point",
                "postgresql",
            )
            for _, label in DRAIN_PARTS
        ),
        ("drain into JetStream vs HTTP batch", "postgresql"),
        ("drain into RabbitMQ vs HTTP batch", "postgresql"),
        ("machine CPU per message, JetStream vs HTTP batch drain", "postgresql"),
        ("machine CPU per message, RabbitMQ vs HTTP batch drain", "postgresql"),
        ("drain into JetStream vs bare publishers into JetStream", "postgresql"),
        ("drain into RabbitMQ vs bare publishers into RabbitMQ", "postgresql"),
        ("drain into JetStream vs bare relays into JetStream", "postgresql"),
        ("drain into RabbitMQ vs bare relays into RabbitMQ", "postgresql"),
        ("JetStream server's own CPU per message", "postgresql"),
        ("RabbitMQ server's own CPU per message", "postgresql"),
        ("consume from JetStream", "postgresql"),
        ("consume from RabbitMQ", "postgresql"),
        ("live commit-to-receipt p50", "postgresql"),
        ("live commit-to-receipt p99", "postgresql"),
        ("live backlog at stop", "postgresql"),
        ("live p50 vs bare relay", "postgresql"),
        ("live p99 vs bare relay", "postgresql"),
        ("live producers' rate, ours vs bare relay runs", "postgresql"),
        ("keyed drain vs unkeyed, one key", "postgresql"),
        ("keyed drain vs unkeyed, few long keys", "postgresql"),
        ("keyed drain vs unkeyed, many short keys", "postgresql"),
        ("keyed drain rate, one key, single mode", "postgresql"),
        ("keyed live p50 vs unkeyed", "postgresql"),
        ("keyed live p99 vs unkeyed", "postgresql"),
        ("drain, tracing configured and exporting vs not configured", "postgresql"),
        ("drain, opentelemetry-api installed but no provider vs not importable", "postgresql"),
        ("live p50, tracing configured vs not configured", "postgresql"),
        ("receiver CPU per stored reply, batches of 1,000", "postgresql"),
        ("tasks vs PGQueuer, thread handlers", "postgresql"),
        ("tasks vs PGQueuer, async handlers", "postgresql"),
        ("async worker x500, 100 ms waits vs no-op", "postgresql"),
        ("async worker x500, 100 ms waits vs 500 / 0.1 s", "postgresql"),
        ("threads x500, 100 ms waits vs async no-op", "postgresql"),
        ("task wake-up p50, NOTIFY", "postgresql"),
        ("task wake-up p90, NOTIFY", "postgresql"),
        ("task wake-up p50, polling every 0.5 s", "postgresql"),
        ("claim latency with history", "postgresql"),
        ("drain slowdown with history", "postgresql"),
        ("relay peak RSS draining", "postgresql"),
        ("console slowest page", "postgresql"),
        ("console slowest first answer after start", "postgresql"),
        ("console overview", "postgresql"),
        ("console bulk requeue", "postgresql"),
        ("WAL per delivered message", "postgresql"),
        ("full-page images per delivered message", "postgresql"),
        ("index entries per delivered message", "postgresql"),
        ("HOT share of message updates", "postgresql"),
        ("receiver WAL per delivered message", "postgresql"),
        ("WAL per finished task", "postgresql"),
        ("full-page images per finished task", "postgresql"),
        ("index entries per finished task", "postgresql"),
        ("HOT share of task updates", "postgresql"),
        ("WAL per lease renewal", "postgresql"),
        ("HOT share of lease renewals", "postgresql"),
        ("drain vs PostgreSQL", "sqlite"),
        ("tasks vs PostgreSQL", "sqlite"),
        ("publish vs bare insert", "sqlite"),
        ("publish vs bare insert", "mysql"),
        ("claim latency with history", "mysql"),
        ("drain slowdown with history", "mysql"),
        ("drain vs PostgreSQL", "mysql"),
        ("tasks vs PostgreSQL", "mysql"),
    }
    for row in document["rows"]:
        assert row["scenario"] in table
        if row["unit"] in (
            "messages/s",
            "tasks/s",
            "us/transaction",
            "us/claim",
            "MB",
            "CPU us/message",
            "CPU us/reply",
            "commits/s",
            "WAL bytes/message",
            "WAL bytes/task",
            "WAL bytes/renewal",
            "entries/message",
            "entries/task",
        ):
            if row["scenario"].endswith("server's own CPU per message") or in_parts(row):
                # A quick drain may take the broker, or one part of a drain, less than one
                # clock tick (10 ms) of CPU; that the broker was found at all is checked
                # where it is read, that every part was found below.
                assert row["ours"] >= 0, row
            else:
                assert row["ours"] > 0, row
        if row["unit"] == "HOT % of updates":
            # A share may be none before and after (no ratio then), never more than all.
            assert 0 <= row["baseline"] <= 100, row
            assert row["ratio"] is None or row["ratio"] >= 0, row
        elif in_parts(row):
            assert row["baseline"] >= 0, row
        elif row["baseline"] is not None:
            assert row["baseline"] > 0, row
            assert row["ratio"] > 0, row
    # Each part's CPU was read in both drains, and the parts together spent some.
    flows = rows[("drain vs bare relay", "postgresql")]["runs"][0]
    for side in ("ours", "bare"):
        spent = [flows[f"{side}_cpu_us_{part}"] for part, _ in DRAIN_PARTS]
        assert sum(spent) > 0, flows
    # The comparisons ran in both orders, and the ceilings are the best of their sweeps.
    ordered = {key for key, row in rows.items() if row["orders"] is not None}
    assert {
        ("drain vs naive relay", "postgresql"),
        ("drain vs bare relay", "postgresql"),
        ("drain into JetStream vs HTTP batch", "postgresql"),
        ("drain into RabbitMQ vs bare publishers into RabbitMQ", "postgresql"),
        ("drain into RabbitMQ vs bare relays into RabbitMQ", "postgresql"),
        ("live p99 vs bare relay", "postgresql"),
        ("keyed drain vs unkeyed, one key", "postgresql"),
        ("keyed live p50 vs unkeyed", "postgresql"),
        ("drain, tracing configured and exporting vs not configured", "postgresql"),
        ("drain, opentelemetry-api installed but no provider vs not importable", "postgresql"),
        ("live p50, tracing configured vs not configured", "postgresql"),
    } <= ordered
    for key in ordered:
        assert set(rows[key]["orders"]) == {"ours first", "baseline first"}, rows[key]
        assert all(ratio > 0 for ratio in rows[key]["orders"].values()), rows[key]
    for scenario, swept in (
        ("drain vs bare relay", "bare"),
        ("drain into JetStream vs bare publishers into JetStream", "nats_bare"),
        ("drain into RabbitMQ vs bare publishers into RabbitMQ", "rabbitmq_bare"),
        ("drain into JetStream vs bare relays into JetStream", "nats_bare_relay"),
        ("drain into RabbitMQ vs bare relays into RabbitMQ", "rabbitmq_bare_relay"),
    ):
        row = rows[(scenario, "postgresql")]
        assert row["swept"] == swept
        run = row["runs"][0]
        points = {point: run[f"{swept}_{point.label}"] for point in sweep.QUICK}
        won = sweep.Point(int(run[f"{swept}_batch"]), int(run[f"{swept}_in_flight"]))
        # The point named is the run's fastest, and the row's baseline the run's ceiling
        # figure (that it is a second measurement: tests/test_benchmark_baselines.py).
        assert points[won] == max(points.values()), row
        assert run[swept] == row["baseline"] > 0, row
        assert "won: " in row["scenario"]
    # Every traced run exported spans (the suite fails otherwise: this checks it counted).
    traced = rows[("live p50, tracing configured vs not configured", "postgresql")]["runs"][0]
    exports = {k: v for k, v in traced.items() if k.endswith("_exports")}
    assert set(exports) == {
        "drain_traced_exports",
        "drain_traced_after_exports",
        "live_traced_exports",
        "live_traced_after_exports",
    }, traced
    assert all(count > 0 for count in exports.values()), traced
    pages = rows[("console slowest page", "postgresql")]["runs"][0]
    assert pages["slowest_ms"] > 0
    assert pages["slowest_ms"] == max(v for k, v in pages.items() if k.endswith("_median_ms"))
    assert pages["slowest_first_ms"] == max(v for k, v in pages.items() if k.endswith("_first_ms"))
    assert pages["bulk_requeue_s"] > 0
    large = rows[("console overview", "postgresql")]["runs"][0]
    assert large["overview_median_ms"] > 0
    assert [k for k in large if k.endswith("_median_ms")] == ["overview_median_ms"]
