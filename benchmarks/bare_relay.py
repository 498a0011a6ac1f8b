"""The bare relay: the ceiling the relay is held to, on the same database and backlog.

Run: .venv/bin/python -m benchmarks.bare_relay [--quick]

The least a relay with at-least-once delivery does, in psycopg 3 directly: in
one transaction, claim up to 500 pending, due messages with FOR UPDATE SKIP
LOCKED, POST them as one plain JSON array of {reply_id, body} (each body its
stored JSON text) on one keep-alive httpx client, and on a 2xx mark them sent
and commit. The claim's locks are held across the POST, so each batch costs one
transaction and one commit (ours claims, commits, sends, then settles in a
second transaction). A relay that dies mid-POST releases its locks and the
batch goes again; the receiver's ON CONFLICT makes that harmless. Nothing else:
no signature, no fence or lease, no attempts or backoff, no ordering keys or
destinations, no strict JSON, no per-item answers, no metrics. When a claim
finds nothing it waits, as ours does, for the NOTIFY the outbox's insert
trigger sends (polling every 50 ms besides), so a live latency compares
delivery, not polling intervals. Its receiver is benchmarks.bare_receiver.

One run measures, back to back on fresh databases with the same prefill: our
HTTP batch drain (benchmarks.relay_bench.drain, 2 relays) and as many bare
relays; then live commit-to-receipt with the same producer processes at the same
fixed rate through one of our relays, and through one bare relay.

A relay process alone: python -m benchmarks.bare_relay relay DB_URL TARGET_URL
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import IO, Any

import httpx
import psycopg
import sqlalchemy as sa

import outbox
from benchmarks import bare_receiver
from benchmarks.bare_receiver import bare_receipts, conninfo
from benchmarks.relay_bench import (
    ROOT,
    drain,
    free_port,
    fresh_database,
    live,
    live_through,
    log,
    prefill,
    run_alone,
    timed_drain,
    wait_healthy,
)
from outbox.db.dialect import NOTIFY_CHANNEL

BATCH = 500
POLL_SECONDS = 0.05
"""The fallback poll between NOTIFY wake-ups: our live relays' poll_interval."""
RELAYS = 2
"""Relay processes in a drain: the suite's HTTP batch drain's."""
LIVE_PRODUCERS = 4
LIVE_RELAYS = 1
"""The suite's live latency runs: 4 producer processes, one relay."""
LIVE_RATE = 50.0
"""Commits per second per producer in the paced live runs: 200/s in all, about half of what 4
producers reached at their full rate beside one of our relays on 2 busy shared cores (300 to
500/s; beside a bare relay, 700 to 1,000/s), so neither relay is saturated and the producers
keep their pace in both runs."""
READY_SECONDS = 60.0

CLAIM = (
    "SELECT id, reply_id, body FROM outbox_messages "
    "WHERE state = 'pending' AND available_at <= extract(epoch from statement_timestamp()) "
    # The order of the pending partial index, which then answers the claim.
    "ORDER BY available_at, id LIMIT %s FOR UPDATE SKIP LOCKED"
)
MARK_SENT = (
    "UPDATE outbox_messages SET state = 'sent', "
    "sent_at = extract(epoch from statement_timestamp()) WHERE id = ANY(%s)"
)
JSON_HEADERS = {"content-type": "application/json"}


def relay(db: str, target: str) -> None:
    """Deliver batches from the database at `db` (a psycopg conninfo) to `target`, forever."""
    with (
        psycopg.connect(db) as conn,
        psycopg.connect(db, autocommit=True) as listener,
        httpx.Client(timeout=10) as client,
    ):
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        print("ready", flush=True)
        while True:
            # What was announced so far, this claim sees.
            for _ in listener.notifies(timeout=0):
                pass
            rows = conn.execute(CLAIM, (BATCH,)).fetchall()
            if not rows:
                conn.rollback()
                for _ in listener.notifies(timeout=POLL_SECONDS, stop_after=1):
                    pass
                continue
            body = json.dumps([{"reply_id": r, "body": bytes(b).decode()} for _, r, b in rows])
            response = client.post(target, content=body, headers=JSON_HEADERS)
            if response.is_success:
                conn.execute(MARK_SENT, ([row[0] for row in rows],))
                conn.commit()
            else:
                conn.rollback()
                threading.Event().wait(POLL_SECONDS)


def wait_ready(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a bare relay process's `ready` line, or raise with what it said."""
    out: IO[bytes] | None = proc.stdout
    assert out is not None, "started with stdout piped"
    readable, _, _ = select.select([out], [], [], READY_SECONDS)
    if not readable or out.readline() != b"ready\n":
        proc.kill()
        raise RuntimeError(f"a bare relay did not start: {proc.communicate()[1].decode()}")


@contextmanager
def bare_processes(url: str, relays: int) -> Iterator[None]:
    """The bare receiver and `relays` bare relay processes on the database at `url`."""
    bare_receiver.create_table(url)
    port = free_port()
    target = f"http://127.0.0.1:{port}/replies"
    # Our interpreter running our modules, with arguments built here.
    command = [sys.executable, "-m"]
    with ExitStack() as stack:
        server = subprocess.Popen(
            [*command, "benchmarks.bare_receiver", url, str(port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        stack.callback(stop, server)
        wait_healthy(f"http://127.0.0.1:{port}/healthz")
        procs = []
        for _ in range(relays):
            proc = subprocess.Popen(
                [*command, "benchmarks.bare_relay", "relay", conninfo(url), target],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            stack.callback(stop, proc)
            procs.append(proc)
        # Measure from when every relay is up, as our relays are.
        for proc in procs:
            wait_ready(proc)
        yield


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process and reap it."""
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)


def count_receipts(url: str) -> int:
    """Receipts the bare receiver stored."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(bare_receipts)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def bare_drain(total: int, relays: int = RELAYS) -> dict[str, Any]:
    """`relays` bare relays deliver a prefilled backlog of `total`, timed as our drain is."""
    with fresh_database() as url:
        log(f"  prefill {total} messages for the bare relay")
        prefill(url, total)
        result = timed_drain(url, total, lambda: bare_processes(url, relays))
        stored = count_receipts(url)
    if not result["complete"] or stored != total:
        raise RuntimeError(f"the bare relays did not drain (stored {stored}): {result}")
    return {"scenario": f"drain-bare-{relays}-relays", **result}


def bare_live(duration: float, rate: float = LIVE_RATE) -> dict[str, Any]:
    """Live commit-to-receipt through one bare relay, the producers paced at `rate` each."""
    return {
        "scenario": f"live-bare-{LIVE_PRODUCERS}-producers-paced-{rate:g}",
        **live_through(
            duration,
            LIVE_PRODUCERS,
            rate,
            lambda url, _workdir: bare_processes(url, LIVE_RELAYS),
            bare_receipts,
        ),
    }


def live_pair(duration: float, rate: float = LIVE_RATE) -> dict[str, float]:
    """Ours, then the bare relay, each under the same paced producers: quantiles and rates."""
    ours = live(duration, LIVE_PRODUCERS, LIVE_RELAYS, rate)
    log(f"  ours: {ours}")
    bare = bare_live(duration, rate)
    log(f"  bare: {bare}")
    figures: dict[str, float] = {}
    for name, result in (("ours", ours), ("bare", bare)):
        figures |= {
            f"{name}_p50_ms": float(result["p50_ms"]),
            f"{name}_p99_ms": float(result["p99_ms"]),
            f"{name}_producer_rate": float(result["rate"]),
            f"{name}_backlog_at_stop": float(result["backlog_at_stop"]),
        }
    return figures


def sizes(quick: bool) -> tuple[int, float]:
    """Messages per drain and seconds of live load: moderate, or a smoke run's."""
    return (3_000, 3.0) if quick else (50_000, 10.0)


def run(quick: bool) -> dict[str, float]:
    """Our drain and the bare relays', then the paced live pair, back to back."""
    total, seconds = sizes(quick)
    ours = drain(total, "batch", RELAYS, 1000)
    if not ours["complete"]:
        raise RuntimeError(f"the relays did not drain: {ours}")
    log(f"  ours: {ours}")
    bare = bare_drain(total)
    log(f"  bare: {bare}")
    return {
        "ours_drain": float(ours["rate"]),
        "bare_drain": float(bare["rate"]),
        "ours_cpu_us": float(ours["cpu_us_per_message"]),
        "bare_cpu_us": float(bare["cpu_us_per_message"]),
        **live_pair(seconds),
    }


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON; or, given `relay DB TARGET`, be one relay."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["relay"]:
        relay(*args[1:3])
        return 0
    return run_alone("python -m benchmarks.bare_relay", run, args)


if __name__ == "__main__":
    sys.exit(main())
