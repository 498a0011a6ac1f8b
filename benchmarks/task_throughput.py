"""Task throughput: `outbox worker` processing against PGQueuer draining the same jobs.

Run alone: .venv/bin/python -m benchmarks.task_throughput [--quick]

Ours: `tasks` pending tasks, stored as intake stores them, drained by real
`outbox.worker.Worker`s (one per process, a no-op handler) whose every finish
commits the task's result and its reply row in one transaction. The baseline:
PGQueuer draining as many no-op jobs with its own dequeue and completion (which
deletes the job and writes a log row). Both sides run the same number of
processes, each holding the same number of items at once (our Worker's
concurrency is PGQueuer's batch size), and are timed from the first item taken
to the moment none is left. The SQLite figure is ours again, on a file; the MySQL one
ours again, on MariaDB here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import uvloop

import outbox
from benchmarks.databases import analyze, fresh_mysql_database
from benchmarks.relay_bench import fresh_database, log, run_alone
from outbox.canonical import canonical_bytes
from outbox.claim import Claim
from outbox.intake import AuthContext, Envelope, accept
from outbox.process_gc import tune_for_long_run
from outbox.schema import inbox, messages, tasks
from outbox.tasks import TaskQueue
from outbox.worker import Handler, Worker

WORKERS = 2  # consumer processes: one per core of the benchmark machine
CONCURRENCY = 10  # tasks held at once per process; PGQueuer's batch size (its default too)
SOURCE = "bench-source"
DEADLINE_SECONDS = 600.0
POLL_SECONDS = 0.02
PGQUEUER_ENTRYPOINT = "noop"
PGQUEUER_INSTALL = ".venv/bin/pip install -e '.[dev,bench]'"


def noop(claim: Claim, stop: threading.Event) -> None:
    """A handler that does nothing, so the figure is the queue's own cost."""


async def async_noop(claim: Claim, stop: asyncio.Event) -> None:
    """The same as an `async def`, as PGQueuer's entrypoint is."""


HANDLERS: dict[str, Handler] = {"threads": noop, "async": async_noop}
"""The no-op handler of each kind a Worker runs."""


def job_payload(n: int) -> dict[str, Any]:
    """The payload of task or job `n`: the same bytes on both sides."""
    return {"n": n, "work": "x" * 32}


# --- prefill -----------------------------------------------------------------------------


def intake_rows(count: int, now: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(inbox rows, task rows) for `count` envelopes, exactly as receive() would store them."""
    auth = AuthContext(SOURCE)
    inbox_rows, task_rows = [], []
    for n in range(count):
        item = accept(auth, Envelope(f"bench-{n}", SOURCE, job_payload(n), now + 86_400))
        inbox_rows.append(
            {
                "principal": item.principal,
                "message_id": item.message_id,
                "content_hash": item.content_hash,
                "content": item.content,
                "task_id": item.task_id,
                "received_at": now,
            }
        )
        task_rows.append(
            {
                "task_id": item.task_id,
                "tenant_id": item.tenant_id,
                "payload": item.payload,
                "priority": item.priority,
                "deadline": item.deadline,
                "hops": item.hops,
                "state": "pending",
                "attempts": 0,
                "max_attempts": item.max_attempts,
                "available_at": now,
                "fence": 0,
                "last_error": None,
                "created_at": now,
                "updated_at": now,
                "finished_at": None,
            }
        )
    return inbox_rows, task_rows


def prefill_tasks(url: str, count: int) -> None:
    """Insert `count` pending tasks with their inbox rows in large batches (setup, not timed)."""
    inbox_rows, task_rows = intake_rows(count, time.time())
    engine = outbox.create_engine(url)
    try:
        with engine.begin() as conn:
            for start in range(0, count, 10_000):
                conn.execute(sa.insert(inbox), inbox_rows[start : start + 10_000])
                conn.execute(sa.insert(tasks), task_rows[start : start + 10_000])
        analyze(engine, "outbox_inbox", "outbox_tasks")
    finally:
        engine.dispose()


# --- timing consumer processes -----------------------------------------------------------------


@dataclass(frozen=True)
class Signals:
    """What the parent and its consumer processes say to each other."""

    ready: Any  # a Semaphore each consumer releases once connected
    go: Any  # an Event: start consuming
    stop: Any  # an Event: stop now (the work is done, or the parent gave up)
    cpu: Any  # a Queue of each consumer's CPU seconds spent after `go`

    def start(self) -> float:
        """In a consumer: say it is ready, wait for `go`; returns the CPU clock then."""
        self.ready.release()
        self.go.wait()
        return time.process_time()

    def done(self, started: float) -> None:
        """In a consumer: report the CPU spent since `start`."""
        self.cpu.put(time.process_time() - started)


def timed_drain(
    target: Callable[..., None],
    args: tuple[Any, ...],
    processes: int,
    taken: Callable[[], bool],
    left: Callable[[], bool],
) -> tuple[float, float]:
    """(seconds from the first item taken until none is left, consumers' CPU seconds).

    `taken()` says whether a consumer has taken an item; `left()` whether any item is
    still waiting or unfinished. Each of `processes` spawned processes runs
    target(index, *args, signals): it connects, calls signals.start(), consumes until
    signals.stop (or until it finds nothing left), calls signals.done() and exits 0.
    """
    # One interpreter per consumer, as deployments run them: threads of one process
    # would measure its interpreter lock, not the queue.
    spawn = multiprocessing.get_context("spawn")
    signals = Signals(spawn.Semaphore(0), spawn.Event(), spawn.Event(), spawn.Queue())
    procs = [
        spawn.Process(target=target, args=(index, *args, signals), daemon=True)
        for index in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        wait_ready(signals.ready, procs)
        signals.go.set()
        deadline = time.monotonic() + DEADLINE_SECONDS
        # The clock starts at the first item taken: what a consumer does once when it
        # starts (PGQueuer checks its schema with a score of queries) is not throughput.
        poll_until(lambda: not taken(), procs, deadline)
        started = time.monotonic()
        poll_until(left, procs, deadline)
        elapsed = time.monotonic() - started
    finally:
        signals.stop.set()
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"a consumer failed: exit codes {[p.exitcode for p in procs]}")
    return elapsed, sum(signals.cpu.get(timeout=10) for _ in procs)


def poll_until(busy: Callable[[], bool], procs: list[Any], deadline: float) -> None:
    """Poll while `busy()`; RuntimeError past the deadline or when a consumer died."""
    pause = threading.Event()
    while busy():
        if time.monotonic() > deadline:
            raise RuntimeError(f"consumers did not drain within {DEADLINE_SECONDS:g} s")
        if any(proc.exitcode not in (None, 0) for proc in procs):
            raise RuntimeError(f"a consumer died: exit codes {[p.exitcode for p in procs]}")
        pause.wait(POLL_SECONDS)


def report(label: str, count: int, elapsed: float, cpu: float) -> float:
    """Log the rate and the consumers' CPU per item; return the rate."""
    log(f"  {label}: {count / elapsed:,.0f}/s, consumers' CPU {cpu / count * 1e3:.2f} ms per item")
    return count / elapsed


def wait_ready(ready: Any, procs: list[Any]) -> None:
    """Wait until every process released `ready`; fail early when one has died."""
    deadline = time.monotonic() + 60
    waiting = len(procs)
    while waiting:
        if ready.acquire(timeout=0.5):
            waiting -= 1
        elif any(proc.exitcode is not None for proc in procs):
            raise RuntimeError(f"a consumer died starting: {[p.exitcode for p in procs]}")
        elif time.monotonic() > deadline:
            raise RuntimeError("a consumer process did not start within 60 s")


# --- ours ----------------------------------------------------------------------------------


def our_consumer(index: int, url: str, concurrency: int, kind: str, signals: Signals) -> None:
    """A consumer process: one Worker with the no-op handler of `kind`, built as `outbox
    worker` builds it."""
    timed_worker(url, HANDLERS[kind], f"bench-worker-{index}", concurrency, signals)


def timed_worker(
    url: str,
    handler: Handler,
    owner: str,
    concurrency: int,
    signals: Signals,
    lease: float = 30.0,
    poll_interval: float = 0.05,
) -> None:
    """Run one Worker (as `outbox worker` builds it) between the parent's start and stop.

    poll_interval only matters when the queue looks empty: at the very end.
    """
    with TaskQueue(url, lease=lease) as queue:
        worker = Worker(
            queue, handler, owner=owner, concurrency=concurrency, poll_interval=poll_interval
        )
        with queue.engine.connect():
            pass  # connected before the clock starts
        tune_for_long_run()  # as `outbox worker` does before it runs
        cpu = signals.start()
        threading.Thread(target=stop_when, args=(signals.stop, worker.stop), daemon=True).start()
        worker.run(install_signal_handlers=False)
        signals.done(cpu)


def stop_when(event: Any, stop: Callable[[], None]) -> None:
    """Call `stop` once the parent sets `event` (on a thread of the consumer)."""
    event.wait()
    stop()


# The order of each state's partial index: with statistics taken while every task was
# pending, `state = 'pending' LIMIT 1` alone was a sequential scan past every task done
# so far (a millisecond per poll late in a drain, fifty polls a second), the timing's
# own cost charged to the workers' machine.
INDEX_ORDER = {
    "pending": (tasks.c.priority.desc(), tasks.c.available_at, tasks.c.created_at),
    "running": (tasks.c.tenant_id,),
}


def any_task(engine: sa.Engine, state: str) -> bool:
    """Whether a task is in `state` (pending or running: its partial index answers)."""
    with engine.connect() as conn:
        query = (
            sa.select(tasks.c.task_id)
            .where(tasks.c.state == state)
            .order_by(*INDEX_ORDER[state])
            .limit(1)
        )
        return conn.execute(query).first() is not None


def task_taken(engine: sa.Engine) -> bool:
    """Whether a worker has claimed a task (one is running, or none is left pending)."""
    return any_task(engine, "running") or not any_task(engine, "pending")


def tasks_left(engine: sa.Engine) -> bool:
    """Whether any task is still pending or running."""
    return any_task(engine, "pending") or any_task(engine, "running")


def check_done(engine: sa.Engine, count: int) -> None:
    """Every task done with its reply written, or RuntimeError."""
    with engine.connect() as conn:
        done = conn.execute(
            sa.select(sa.func.count()).select_from(tasks).where(tasks.c.state == "done")
        ).scalar_one()
        replies = conn.execute(
            sa.select(sa.func.count()).select_from(messages).where(messages.c.task_id.is_not(None))
        ).scalar_one()
    if done != count or replies != count:
        raise RuntimeError(f"{done} tasks done and {replies} replies written, of {count}")


def drain_tasks(url: str, count: int, workers: int, concurrency: int, kind: str) -> float:
    """Tasks per second that `workers` Worker processes with `kind` handlers finish from a
    prefilled queue."""
    prefill_tasks(url, count)
    engine = outbox.create_engine(url)
    try:
        elapsed, cpu = timed_drain(
            our_consumer,
            (url, concurrency, kind),
            workers,
            lambda: task_taken(engine),
            lambda: tasks_left(engine),
        )
        check_done(engine, count)
    finally:
        engine.dispose()
    return report(f"{engine.dialect.name}, {kind}", count, elapsed, cpu)


def ours(
    url: str,
    tasks: int,
    workers: int = WORKERS,
    concurrency: int = CONCURRENCY,
    kind: str = "threads",
) -> float:
    """Tasks per second: claim, no-op handler, finish with its reply, on a migrated database."""
    log(f"  ours: {tasks} tasks, {workers} workers x {concurrency}, {kind} handlers")
    return drain_tasks(url, tasks, workers, concurrency, kind)


def sqlite_ours(
    path: Path, tasks: int, workers: int = WORKERS, concurrency: int = CONCURRENCY
) -> float:
    """Tasks per second, as `ours`, on a new SQLite file at `path` (the embedded default)."""
    url = f"sqlite:///{path}"
    outbox.upgrade(url)
    log(f"  ours on SQLite: {tasks} tasks, {workers} workers x {concurrency}")
    return drain_tasks(url, tasks, workers, concurrency, "threads")


# --- PGQueuer ------------------------------------------------------------------------------


def require_pgqueuer() -> None:
    """Raise with the install command when PGQueuer (the `bench` extra) is missing."""
    try:
        import pgqueuer  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"the task throughput baseline needs PGQueuer: run `{PGQUEUER_INSTALL}`"
        ) from exc


def libpq_dsn(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as the plain DSN that psycopg connects with."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def pgqueuer_setup(dsn: str, jobs: int) -> None:
    """Install PGQueuer's schema and enqueue `jobs` no-op jobs in bulk (setup, not timed)."""
    import psycopg
    from pgqueuer import Queries

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        queries = Queries.from_psycopg_connection(conn)
        await queries.install()
        for start in range(0, jobs, 10_000):
            batch = range(start, min(start + 10_000, jobs))
            await queries.enqueue(
                [PGQUEUER_ENTRYPOINT] * len(batch),
                [canonical_bytes(job_payload(n)) for n in batch],
                [0] * len(batch),
            )
        await conn.execute("ANALYZE pgqueuer")


async def pgqueuer_consume(dsn: str, batch: int, signals: Signals) -> None:
    """Run one QueueManager with a no-op entrypoint in drain mode, or until `stop`."""
    import psycopg
    from pgqueuer import Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        manager = QueueManager(Queries.from_psycopg_connection(conn))

        @manager.entrypoint(PGQUEUER_ENTRYPOINT)
        async def nothing(job: Any) -> None:
            """The no-op job."""

        cpu = await asyncio.to_thread(signals.start)

        async def stop_on_signal() -> None:
            """Stop the manager when the parent says so (after a timeout, say)."""
            await asyncio.to_thread(signals.stop.wait)
            manager.shutdown.set()

        watcher = asyncio.create_task(stop_on_signal())
        await manager.run(batch_size=batch, mode=QueueExecutionMode.drain)
        # Drain mode returned: the queue was empty. The watcher's thread ends with `stop`.
        watcher.cancel()
        signals.done(cpu)


def pgqueuer_consumer(index: int, dsn: str, batch: int, signals: Signals) -> None:
    """A consumer process running PGQueuer on uvloop, as its `pgq run` command does."""
    uvloop.run(pgqueuer_consume(dsn, batch, signals))


def pgqueuer_has(engine: sa.Engine, where: str) -> bool:
    """Whether PGQueuer's queue table has a row matching `where`."""
    with engine.connect() as conn:
        found = conn.exec_driver_sql(f"SELECT 1 FROM pgqueuer WHERE {where} LIMIT 1").first()
    return found is not None


def job_taken(engine: sa.Engine) -> bool:
    """Whether PGQueuer has picked a job (one is picked, or none is queued any more)."""
    return pgqueuer_has(engine, "status = 'picked'") or not pgqueuer_has(
        engine, "status = 'queued'"
    )


def jobs_left(engine: sa.Engine) -> bool:
    """Whether PGQueuer still holds a job (completion deletes it, after logging it)."""
    return pgqueuer_has(engine, "true")


def jobs_logged(engine: sa.Engine) -> int:
    """Jobs PGQueuer logged as successful."""
    query = "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'"
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(query).scalar_one())


def pgqueuer_baseline(
    url: str, jobs: int, workers: int = WORKERS, concurrency: int = CONCURRENCY
) -> float:
    """Jobs per second PGQueuer drains: its dequeue, a no-op entrypoint, its completion."""
    require_pgqueuer()
    log(f"  PGQueuer: {jobs} jobs, {workers} processes, batch {concurrency}")
    dsn = libpq_dsn(url)
    asyncio.run(pgqueuer_setup(dsn, jobs))
    engine = outbox.create_engine(url)
    try:
        elapsed, cpu = timed_drain(
            pgqueuer_consumer,
            (dsn, concurrency),
            workers,
            lambda: job_taken(engine),
            lambda: jobs_left(engine),
        )
        done = jobs_logged(engine)
    finally:
        engine.dispose()
    if done != jobs:
        raise RuntimeError(f"PGQueuer logged {done} successful jobs of {jobs}")
    return report("PGQueuer", jobs, elapsed, cpu)


# --- one run ------------------------------------------------------------------------------


def sizes(quick: bool) -> tuple[int, int]:
    """(tasks and jobs per PostgreSQL side, tasks on SQLite).

    Ours is the slow side: about 160 tasks/s on a busy 2-core machine, so 10,000 keep
    it under a minute there. SQLite commits with a full fsync each: fewer tasks.
    """
    return (1_000, 500) if quick else (10_000, 5_000)


def run(quick: bool) -> dict[str, float]:
    """One run: ours (thread, then async handlers) and PGQueuer on fresh PostgreSQL
    databases, then ours on SQLite and on MySQL (thread handlers)."""
    require_pgqueuer()  # before any work: a missing baseline is an error, not a skip
    count, sqlite_count = sizes(quick)
    timings: dict[str, float] = {}
    measures: tuple[tuple[str, Callable[[str, int], float]], ...] = (
        ("ours", ours),
        ("ours_async", partial(ours, kind="async")),
        ("baseline", pgqueuer_baseline),
    )
    for key, measure in measures:
        started = time.monotonic()
        with fresh_database() as url:
            timings[key] = measure(url, count)
        log(f"  {key}: {timings[key]:,.0f}/s ({time.monotonic() - started:.1f} s with setup)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        timings["sqlite"] = sqlite_ours(Path(tmp) / "tasks.db", sqlite_count)
    log(f"  sqlite: {timings['sqlite']:,.0f}/s ({time.monotonic() - started:.1f} s with setup)")
    started = time.monotonic()
    with fresh_mysql_database() as url:
        log(f"  ours on MySQL: {count} tasks, {WORKERS} workers x {CONCURRENCY}")
        timings["mysql"] = drain_tasks(url, count, WORKERS, CONCURRENCY, "threads")
    log(f"  mysql: {timings['mysql']:,.0f}/s ({time.monotonic() - started:.1f} s with setup)")
    return timings


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.task_throughput", run, argv)


if __name__ == "__main__":
    sys.exit(main())
