"""The bare relay: the ceiling the relay is held to, on the same database and backlog.

Run: .venv/bin/python -m benchmarks.bare_relay [--quick]

The least a relay with at-least-once delivery does, in psycopg 3 directly: in
one transaction, claim up to a batch of pending, due messages with FOR UPDATE
SKIP LOCKED, POST them as one plain JSON array of {reply_id, body} (each body
its stored JSON text) on a keep-alive httpx client, and on a 2xx mark them sent
and commit. The claim's locks are held across the POST, so each batch costs one
transaction and one commit (ours claims, commits, sends, then settles in a
second transaction). With N batches in flight, a process runs N such loops on
threads, each with its own connection, so N claims, POSTs and commits overlap as
ours overlap its requests in flight. A relay that dies mid-POST releases its
locks and the batch goes again; the receiver's ON CONFLICT makes that harmless.
Nothing else: no signature, no fence or lease, no attempts or backoff, no
ordering keys or destinations, no strict JSON, no per-item answers, no metrics.
When a claim finds nothing it waits, as ours does, for the NOTIFY the outbox's
insert trigger sends (polling every 50 ms besides), so a live latency compares
delivery, not polling intervals. Its receiver is benchmarks.bare_receiver.

It is the ceiling only at its best settings: a drain sweeps batch size by
batches in flight (benchmarks.sweep), and the fastest point, measured again, is the
ceiling.

One run measures, on fresh databases with the same prefill: the bare relays'
sweep (as many relays as ours), our HTTP batch drain (benchmarks.relay_bench.drain,
2 relays), the sweep's winner again, then ours again, so each order (ours first,
the bare relay first) gives a ratio of drains run back to back; then live
commit-to-receipt with the same producer processes at the same fixed rate through
one of our relays, one bare relay, and ours again.

A relay process alone: python -m benchmarks.bare_relay relay DB_URL TARGET_URL BATCH IN_FLIGHT
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import psycopg
import sqlalchemy as sa

import outbox
from benchmarks import bare_receiver, sweep
from benchmarks.bare_receiver import bare_receipts, conninfo
from benchmarks.relay_bench import (
    READY_SECONDS,
    ROOT,
    drain,
    drain_part,
    free_port,
    fresh_database,
    live,
    live_through,
    log,
    prefill,
    ready_processes,
    run_alone,
    timed_drain,
    wait_healthy,
)
from outbox.db.dialect import NOTIFY_CHANNEL

POLL_SECONDS = 0.05
"""The fallback poll between NOTIFY wake-ups: our live relays' poll_interval."""
RELAYS = 2
"""Relay processes in a drain: the suite's HTTP batch drain's."""
OURS_BATCH = 1000
"""Our relays' claim batch in the drain (and the reference receiver's most per POST)."""
LIVE_PRODUCERS = 4
LIVE_RELAYS = 1
"""The suite's live latency runs: 4 producer processes, one relay."""
LIVE_POINT = sweep.Point(500, 1)
"""The bare relay's settings in the live runs, where a few messages wait at a time."""
LIVE_RATE = 50.0
"""Commits per second per producer in the paced live runs: 200/s in all, about half of what 4
producers reached at their full rate beside one of our relays on 2 busy shared cores (300 to
500/s; beside a bare relay, 700 to 1,000/s), so neither relay is saturated and the producers
keep their pace in both runs."""

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


class Wakeups:
    """NOTIFYs counted, so a loop that found nothing sleeps until one after its claim."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0

    def seen(self) -> int:
        """How many have come so far: read before a claim."""
        with self._changed:
            return self._count

    def announce(self) -> None:
        """One more came: wake every loop waiting."""
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def wait_after(self, seen: int, seconds: float) -> None:
        """Until one comes after `seen` was read, or `seconds` pass."""
        with self._changed:
            self._changed.wait_for(lambda: self._count != seen, seconds)


def listen(db: str, wakeups: Wakeups, up: threading.Semaphore) -> None:
    """Announce each NOTIFY of the outbox's insert trigger, forever."""
    with psycopg.connect(db, autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        up.release()
        for _ in listener.notifies():
            wakeups.announce()


def deliver(
    db: str,
    target: str,
    batch: int,
    wakeups: Wakeups,
    client: httpx.Client,
    up: threading.Semaphore,
) -> None:
    """One batch in flight: claim, POST, mark sent and commit, forever."""
    with psycopg.connect(db) as conn:
        up.release()
        while True:
            seen = wakeups.seen()
            rows = conn.execute(CLAIM, (batch,)).fetchall()
            if not rows:
                conn.rollback()
                wakeups.wait_after(seen, POLL_SECONDS)
                continue
            body = json.dumps([{"reply_id": r, "body": bytes(b).decode()} for _, r, b in rows])
            response = client.post(target, content=body, headers=JSON_HEADERS)
            if response.is_success:
                conn.execute(MARK_SENT, ([row[0] for row in rows],))
                conn.commit()
            else:
                conn.rollback()
                threading.Event().wait(POLL_SECONDS)


def relay(db: str, target: str, batch: int, in_flight: int) -> None:
    """Deliver from the database at `db` (a psycopg conninfo) to `target` with `in_flight`
    batches of up to `batch` in flight, until the process is ended."""
    wakeups, up = Wakeups(), threading.Semaphore(0)
    # One keep-alive pool for the process, a connection per batch in flight.
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    with httpx.Client(timeout=10, limits=limits) as client:
        threads = [threading.Thread(target=listen, args=(db, wakeups, up), daemon=True)]
        threads += [
            threading.Thread(
                target=deliver, args=(db, target, batch, wakeups, client, up), daemon=True
            )
            for _ in range(in_flight)
        ]
        for thread in threads:
            thread.start()
        # Ready once every loop and the listener hold their database connections.
        for _ in threads:
            if not up.acquire(timeout=READY_SECONDS):
                raise RuntimeError("a bare relay loop did not connect")
        print("ready", flush=True)
        # A loop that fails ends the process: a ceiling must not run short-handed unseen.
        while all(thread.is_alive() for thread in threads):
            threading.Event().wait(0.5)
    raise RuntimeError("a bare relay loop died")


@contextmanager
def bare_processes(url: str, relays: int, point: sweep.Point = LIVE_POINT) -> Iterator[None]:
    """The bare receiver and `relays` bare relay processes at `point` on the database at `url`."""
    bare_receiver.create_table(url)
    port = free_port()
    target = f"http://127.0.0.1:{port}/replies"
    with ExitStack() as stack:
        # Our interpreter running our module, with arguments built here.
        server = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bare_receiver", url, str(port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        stack.callback(stop, server)
        wait_healthy(f"http://127.0.0.1:{port}/healthz")
        settings = (str(point.batch), str(point.in_flight))
        command = ("benchmarks.bare_relay", "relay", conninfo(url), target, *settings)
        # Measure from when every relay is up, as our relays are.
        stack.enter_context(ready_processes(*[command] * relays))
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


def bare_drain(total: int, point: sweep.Point, relays: int = RELAYS) -> dict[str, Any]:
    """`relays` bare relays at `point` deliver a prefilled backlog of `total`, timed as our
    drain is; the figures of timed_drain, CPU per part included."""
    with fresh_database() as url:
        log(f"  prefill {total} messages for the bare relay at {point.label}")
        prefill(url, total)
        result = timed_drain(
            url, total, lambda: bare_processes(url, relays, point), parts=drain_part
        )
        stored = count_receipts(url)
    if not result["complete"] or stored != total:
        raise RuntimeError(f"the bare relays did not drain (stored {stored}): {result}")
    log(f"  bare at {point.label}: {result}")
    return result


def cpu_parts(name: str, result: dict[str, Any]) -> dict[str, float]:
    """A drain's CPU per message by part (timed_drain's `cpu_us_<part>`) as `name`_cpu_us_<part>."""
    return {
        f"{name}_{key}": float(value) for key, value in result.items() if key.startswith("cpu_us_")
    }


def bare_points(total: int, points: Iterable[sweep.Point]) -> tuple[dict[str, float], sweep.Point]:
    """The bare relays' drain at each point (sweep.chosen's figures), and the fastest point."""
    return sweep.chosen("bare", points, lambda point: float(bare_drain(total, point)["rate"]))


def bare_at(total: int, point: sweep.Point) -> dict[str, float]:
    """The bare relays' drain at `point` (a sweep's winner, measured again) as `bare`, with
    its CPU per part (`bare_cpu_us_<part>`)."""
    result = bare_drain(total, point)
    return {"bare": float(result["rate"]), **cpu_parts("bare", result)}


def ours_drain(total: int) -> dict[str, Any]:
    """Our HTTP batch drain (RELAYS relays, batches of OURS_BATCH), which must finish: the
    figures of timed_drain, CPU per part included."""
    # Into the reference receiver storing receipts only, as the bare receiver does.
    result = drain(total, "batch", RELAYS, OURS_BATCH, reference_effect=False)
    if not result["complete"]:
        raise RuntimeError(f"the relays did not drain: {result}")
    log(f"  ours: {result}")
    return result


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


def live_pair(duration: float, rate: float = LIVE_RATE, keys: int = 0) -> dict[str, float]:
    """Ours, the bare relay, then ours again (`ours_after_`), each under the same paced
    producers: quantiles and rates, a pair for each order.

    With `keys`, ours with the messages over that many ordering keys (`keyed_`) runs
    between the bare relay and ours again: the unkeyed runs before and after it are its
    baseline in each order, under the same producers at the same pace.
    """
    figures: dict[str, float] = {}
    for name in ("ours", "bare", *(("keyed",) if keys else ()), "ours_after"):
        if name == "bare":
            result = bare_live(duration, rate)
        else:
            result = live(
                duration,
                LIVE_PRODUCERS,
                LIVE_RELAYS,
                rate,
                keys if name == "keyed" else 0,
                reference_effect=False,
            )
        log(f"  {name}: {result}")
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
    """The bare relays' sweep; our drain, the sweep's winner measured again, ours again; then
    the paced live runs."""
    total, seconds = sizes(quick)
    swept, winner = bare_points(total, sweep.grid(quick))
    ours = ours_drain(total)
    return {
        **swept,
        "ours_drain": float(ours["rate"]),
        **cpu_parts("ours", ours),
        **bare_at(total, winner),
        "ours_after_drain": float(ours_drain(total)["rate"]),
        **live_pair(seconds),
    }


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON; or, given `relay DB TARGET BATCH IN_FLIGHT`,
    be one relay."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["relay"]:
        db, target, batch, in_flight = args[1:5]
        relay(db, target, int(batch), int(in_flight))
        return 0
    return run_alone("python -m benchmarks.bare_relay", run, args)


if __name__ == "__main__":
    sys.exit(main())
