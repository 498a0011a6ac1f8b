"""Worker scenarios for handlers that wait: throughput at concurrency 500, NOTIFY wake-up.

Run alone: .venv/bin/python -m benchmarks.worker_waits [--quick]

Throughput: a prefilled backlog drained by one Worker process (as `outbox worker`
runs it), timed from the first task taken to the moment none is left (the
helpers of benchmarks.task_throughput). The async worker, concurrency 500, whose
handlers each `await asyncio.sleep(0.1)`, against the same worker with no-op
async handlers in the same run: the no-op figure is what this machine can claim
and finish, so the ratio says how much of it waiting handlers keep. It cannot
pass (500 / 0.1 s) / the no-op rate: 500 slots of 100 ms finish at most 5,000
tasks/s, and each slot's turn also holds its claim and its result's commit. The
thread worker with the same 100 ms handlers (`time.sleep`) is reported beside it.

Wake-up: one idle Worker process (a plain handler, concurrency 1, poll interval
5 s); the parent receives one task at a time (TaskQueue.receive, committed) once
the previous one has started, and measures from receive()'s return to the
handler's start, both on this machine's wall clock. The same with LISTEN off and
a 0.5 s poll shows what the NOTIFY replaces.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Iterable
from functools import partial
from typing import Any

import outbox
from benchmarks.relay_bench import fresh_database, log, run_alone
from benchmarks.task_throughput import (
    Signals,
    check_done,
    prefill_tasks,
    report,
    stop_when,
    task_taken,
    tasks_left,
    timed_drain,
    timed_worker,
)
from outbox.claim import Claim
from outbox.intake import AuthContext, Envelope
from outbox.tasks import TaskQueue
from outbox.worker import Handler, Worker

CONCURRENCY = 500  # the issue's: handlers held at once by one worker
THREAD_CONCURRENCY = 500  # the thread worker beside it: one thread per slot
WAIT_SECONDS = 0.1  # what each waiting handler awaits
LEASE = 30.0  # `outbox worker`'s default
DRAIN_POLL = 0.05  # the draining worker's poll interval: it only matters at the very end
IDLE_POLL = 5.0  # the listening worker's: a wake-up sooner than this came from the NOTIFY
BASELINE_POLL = 0.5  # the polling-only worker's
SOURCE = "bench-source"
# Pauses before each receive: spread over BASELINE_POLL.
PAUSES = tuple(0.01 + BASELINE_POLL * k / 7 for k in (3, 0, 5, 1, 6, 2, 4))
WAKEUP_TIMEOUT = 30.0  # seconds a received task may wait to be taken before the run fails


# --- handlers ------------------------------------------------------------------------


async def async_noop(claim: Claim, stop: asyncio.Event) -> None:
    """An async handler that does nothing: the worker's own cost."""


async def async_wait(claim: Claim, stop: asyncio.Event) -> None:
    """An async handler that waits, as one awaiting an HTTP answer would."""
    await asyncio.sleep(WAIT_SECONDS)


def thread_wait(claim: Claim, stop: threading.Event) -> None:
    """A plain handler that waits, holding its thread."""
    time.sleep(WAIT_SECONDS)


HANDLERS: dict[str, Handler] = {
    "async_noop": async_noop,
    "async_wait": async_wait,
    "thread_wait": thread_wait,
}


# --- throughput ------------------------------------------------------------------------


def waiting_consumer(index: int, url: str, kind: str, concurrency: int, signals: Signals) -> None:
    """A consumer process: one Worker running handler `kind`, built as `outbox worker` builds it."""
    owner = f"bench-{kind}-{index}"
    timed_worker(url, HANDLERS[kind], owner, concurrency, signals, LEASE, DRAIN_POLL)


def drain_rate(kind: str, count: int, concurrency: int) -> float:
    """Tasks per second one Worker process running `kind` finishes from a prefilled queue."""
    log(f"  {kind}: {count} tasks, 1 worker x {concurrency}")
    with fresh_database() as url:
        prefill_tasks(url, count)
        engine = outbox.create_engine(url)
        try:
            elapsed, cpu = timed_drain(
                waiting_consumer,
                (url, kind, concurrency),
                1,
                lambda: task_taken(engine),
                lambda: tasks_left(engine),
            )
            check_done(engine, count)
        finally:
            engine.dispose()
    return report(kind, count, elapsed, cpu)


def throughput(count: int) -> dict[str, float]:
    """One run: the no-op baseline, then the async and the thread worker on 100 ms handlers."""
    return {
        "baseline": drain_rate("async_noop", count, CONCURRENCY),
        "async_wait": drain_rate("async_wait", count, CONCURRENCY),
        "thread_wait": drain_rate("thread_wait", count, THREAD_CONCURRENCY),
        # What CONCURRENCY slots each holding a task for WAIT_SECONDS could finish at best.
        "slot_bound": CONCURRENCY / WAIT_SECONDS,
    }


# --- NOTIFY wake-up ----------------------------------------------------------------------


class PollingWorker(Worker):
    """A Worker with its LISTEN off: it finds new tasks by polling alone (the baseline)."""

    def _wakeups(self) -> None:
        return None


def record_start(starts: Any, claim: Claim, stop: threading.Event) -> None:
    """The handler: say when it started (wall clock, shared with the parent process)."""
    starts.put((claim.task_id, time.time()))


def idle_consumer(url: str, listen: bool, poll: float, starts: Any, ready: Any, end: Any) -> None:
    """A consumer process: one idle Worker; each handler reports its start on `starts`."""
    with TaskQueue(url, lease=LEASE) as queue:
        kind = Worker if listen else PollingWorker
        worker = kind(queue, partial(record_start, starts), owner="bench-idle", poll_interval=poll)
        threading.Thread(target=stop_when, args=(end, worker.stop), daemon=True).start()
        if listen:
            threading.Thread(target=say_when, args=(worker.listening, ready), daemon=True).start()
        else:
            ready.set()
        worker.run(install_signal_handlers=False)


def say_when(listening: threading.Event, ready: Any) -> None:
    """Set `ready` once the worker's LISTEN connection is up."""
    listening.wait()
    ready.set()


def wakeups(url: str, count: int, listen: bool, poll: float) -> list[float]:
    """Milliseconds from each task's committed receive to its handler's start."""
    spawn = multiprocessing.get_context("spawn")
    starts, ready, end = spawn.Queue(), spawn.Event(), spawn.Event()
    proc = spawn.Process(
        target=idle_consumer, args=(url, listen, poll, starts, ready, end), daemon=True
    )
    proc.start()
    latencies = []
    try:
        with TaskQueue(url, allowed_sources=[SOURCE], lease=LEASE) as queue:
            if not ready.wait(60):
                raise RuntimeError("the idle worker did not start within 60 s")
            auth = AuthContext(SOURCE)
            for n in range(-1, count):  # the first one warms both sides up
                # Spread over the baseline's poll interval, as tasks arriving at any
                # moment would be; the same moments for both workers.
                time.sleep(PAUSES[n % len(PAUSES)])
                ack = queue.receive(
                    auth, Envelope(f"wake-{n}", SOURCE, {"n": n}, time.time() + 3600)
                )
                committed = time.time()
                task_id, started = starts.get(timeout=WAKEUP_TIMEOUT)
                if task_id != ack.task_id:
                    raise RuntimeError(f"task {ack.task_id} received, {task_id} started")
                if n >= 0:
                    latencies.append((started - committed) * 1e3)
    finally:
        end.set()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    if proc.exitcode != 0:
        raise RuntimeError(f"the idle worker failed: exit code {proc.exitcode}")
    return latencies


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (inclusive method) of `values`."""
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def wakeup_latency(count: int) -> dict[str, float]:
    """One run: the listening worker, then the polling-only one, on fresh databases."""
    figures = {}
    for label, listen, poll in (("notify", True, IDLE_POLL), ("poll", False, BASELINE_POLL)):
        with fresh_database() as url:
            ms = wakeups(url, count, listen, poll)
        figures[f"{label}_p50_ms"] = statistics.median(ms)
        figures[f"{label}_p90_ms"] = quantile(ms, 0.9)
        log(
            f"  wake-up, {label}: p50 {figures[f'{label}_p50_ms']:.1f} ms, "
            f"p90 {figures[f'{label}_p90_ms']:.1f} ms, max {max(ms):.1f} ms"
        )
    return figures


# --- one run ---------------------------------------------------------------------------------


def sizes(quick: bool) -> tuple[int, int]:
    """(tasks per throughput drain, tasks received one by one per wake-up measurement)."""
    return (1_000, 5) if quick else (20_000, 50)


def run(quick: bool) -> dict[str, float]:
    """Throughput, then wake-up latency."""
    tasks, received = sizes(quick)
    return {**throughput(tasks), **wakeup_latency(received)}


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.worker_waits", run, argv)


if __name__ == "__main__":
    sys.exit(main())
