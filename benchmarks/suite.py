"""The benchmark suite: each scenario beside its baseline, measured in the same run.

Run: .venv/bin/python -m benchmarks.suite [--quick] [--runs 3] [--json PATH]

Every scenario is run `--runs` times; each run measures ours and the baseline
back to back on fresh databases, so machine noise hits both. The table gives
medians and the median of the per-run ratios, against the issue's targets.
Scenarios so far: publish overhead, and relay drain against a naive relay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from benchmarks.relay_bench import (
    ROOT,
    SECRET,
    count_sent,
    drain,
    fresh_database,
    log,
    pending_row,
    prefill,
    receiver_process,
    undelivered,
)
from outbox.canonical import canonical_bytes
from outbox.schema import messages


@dataclass
class Row:
    """One line of the table: ours against the baseline, with the target."""

    scenario: str
    unit: str
    ours: float
    baseline: float
    ratio: float
    target: str
    met: bool
    runs: list[dict[str, float]]


def median_row(
    scenario: str,
    unit: str,
    runs: list[dict[str, float]],
    target: str,
    met: Callable[[float], bool],
) -> Row:
    """Medians over the runs; the ratio is the median of each run's own ratio."""
    ratio = statistics.median(r["ours"] / r["baseline"] for r in runs)
    return Row(
        scenario,
        unit,
        round(statistics.median(r["ours"] for r in runs), 1),
        round(statistics.median(r["baseline"] for r in runs), 1),
        round(ratio, 2),
        target,
        met(ratio),
        runs,
    )


# --- publish overhead ---------------------------------------------------------------


def publish_overhead(transactions: int) -> dict[str, float]:
    """Microseconds per transaction: publish() against a bare INSERT of the same row."""
    with fresh_database() as url:
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


# --- drain against a naive relay --------------------------------------------------------


def naive_drain(total: int) -> float:
    """Messages per second the hand-written loop (benchmarks.naive_relay) delivers."""
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        prefill(url, total)
        engine = outbox.create_engine(url)
        with receiver_process(url, Path(tmp)) as target:
            # Our interpreter running our module, with arguments built here.
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.naive_relay", url, target, SECRET],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            try:
                started = time.monotonic()
                deadline = started + 600
                pause = threading.Event()
                while undelivered(engine) and time.monotonic() < deadline:
                    if proc.poll() is not None:
                        raise RuntimeError(f"naive relay died: {proc.communicate()[1].decode()}")
                    pause.wait(0.05)
                elapsed = time.monotonic() - started
            finally:
                proc.terminate()
                proc.communicate(timeout=30)
            sent = count_sent(engine)
        engine.dispose()
    if sent != total:
        raise RuntimeError(f"naive relay sent {sent} of {total}")
    return total / elapsed


def drain_against_naive(ours_total: int, naive_total: int) -> dict[str, float]:
    """Messages per second: our relay (batch mode, 2 relays) and the naive loop."""
    ours = drain(ours_total, "batch", 2, 1000)
    if not ours["complete"]:
        raise RuntimeError(f"our relay did not drain: {ours}")
    return {"ours": float(ours["rate"]), "baseline": naive_drain(naive_total)}


# --- the table ----------------------------------------------------------------------------


def render(rows: list[Row]) -> str:
    """The results as a plain-text table."""
    lines = [
        f"{'scenario':<26} {'unit':<14} {'ours':>10} {'baseline':>10} {'ratio':>7}  "
        f"{'target':<12} met"
    ]
    for row in rows:
        lines.append(
            f"{row.scenario:<26} {row.unit:<14} {row.ours:>10,.1f} {row.baseline:>10,.1f} "
            f"{row.ratio:>7.2f}  {row.target:<12} {'yes' if row.met else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios, print the table, write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "last-run.json"))
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    transactions, ours_total, naive_total = (
        (300, 5_000, 200) if args.quick else (3_000, 200_000, 2_000)
    )
    rows: list[Row] = []
    runs: list[dict[str, float]] = []
    for n in range(1, args.runs + 1):
        log(f"publish overhead, run {n}/{args.runs}")
        runs.append(publish_overhead(transactions))
    rows.append(
        median_row("publish vs bare insert", "us/transaction", runs, "<= 1.3", lambda r: r <= 1.3)
    )
    runs = []
    for n in range(1, args.runs + 1):
        log(f"drain vs naive relay, run {n}/{args.runs}")
        runs.append(drain_against_naive(ours_total, naive_total))
    rows.append(median_row("drain vs naive relay", "messages/s", runs, ">= 20x", lambda r: r >= 20))
    drain_met = statistics.median(r["ours"] for r in runs) >= 30_000
    table = render(rows)
    print(table)
    if not args.quick:
        print(f"drain >= 30,000 messages/s: {'yes' if drain_met else 'NO'}")
    document: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m benchmarks.suite", *(argv or sys.argv[1:])]),
        "quick": args.quick,
        "runs": args.runs,
        "rows": [asdict(row) for row in rows],
    }
    Path(args.json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
