"""Cost growth: claiming and draining with 0 against N finished rows, and the relay's memory.

Run alone: .venv/bin/python -m benchmarks.cost_growth [--quick]

One run measures, on fresh PostgreSQL databases, then (the first two) on MariaDB:
- the task claim's median latency and the relay's drain rate on a database
  with no history and on one with N finished rows (done tasks and their sent
  replies), claims alternating between the two; the partial indexes should
  keep history from slowing either
  (claim_us_history / claim_us_empty <= 1.2, and
  drain_rate_empty / drain_rate_history <= 1.2);
- the peak resident memory of one relay process draining a backlog
  (relay_rss_mb < 150 for 1,000,000 rows).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import sqlalchemy as sa

import outbox
from benchmarks.databases import analyze, fresh_mysql_database
from benchmarks.relay_bench import (
    DRAIN_DEADLINE_SECONDS,
    children_running,
    drain_backlog,
    fresh_database,
    log,
    receiver_process,
    relay_processes,
    run_alone,
    sent_since,
    undelivered,
)
from benchmarks.task_throughput import prefill_tasks
from outbox.canonical import canonical_bytes
from outbox.ddl import MYSQL
from outbox.messages import TASK_REPLY_PREFIX, TaskReply, task_reply_body
from outbox.schema import messages
from outbox.tasks import TaskQueue

CLAIM_WARMUP = 20  # connection, compiled statements, and psycopg's prepare after 5 runs
CLAIMS = 300  # timed claims, each taking one of a few hundred pending tasks
DRAIN_RELAYS, DRAIN_BATCH = 2, 1000  # as the suite's drain against the naive relay
RSS_LIMIT_MB = 150
RSS_SAMPLE_SECONDS = 0.1


@contextmanager
def timed(step: str) -> Iterator[None]:
    """Log how long a step took."""
    started = time.monotonic()
    yield
    log(f"  {step}: {time.monotonic() - started:.1f} s")


# --- rows ---------------------------------------------------------------------------------

# Finished history as a worker and a relay leave it: done tasks (ids are sha256 hex, as
# intake derives them, so the primary key is as large and as scattered) and their sent
# replies. Bodies are built by the server around one that Python formats (see
# around_marker), so they are the bytes the product would have written.
HISTORY_TASKS = sa.text(
    "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, state, "
    "attempts, max_attempts, available_at, owner, fence, result, created_at, updated_at, "
    "finished_at) "
    "SELECT encode(sha256(convert_to('history-' || n, 'UTF8')), 'hex'), 'bench-source', "
    ":payload_head || n || :payload_tail, 0, :now - n * 0.001 + 86400, 0, 'done', 1, 3, "
    ":now - n * 0.001, 'bench-worker', 1, 'null', :now - n * 0.001, :now - n * 0.001 + 0.01, "
    ":now - n * 0.001 + 0.01 "
    "FROM generate_series(1, :rows) AS n"
)
HISTORY_REPLIES = sa.text(
    "INSERT INTO outbox_messages (reply_id, task_id, destination, body, content_hash, headers, "
    "state, attempts, available_at, owner, fence, last_status, created_at, sent_at) "
    "SELECT :reply_prefix || t.task_id, t.task_id, 'default', b.body, "
    "encode(sha256(b.body), 'hex'), '{}', 'sent', 1, t.finished_at, 'bench-relay', 1, 200, "
    "t.finished_at, t.finished_at + 0.05 "
    "FROM outbox_tasks AS t, "
    "LATERAL (SELECT convert_to(:body_head || t.task_id || :body_tail, 'UTF8') AS body) AS b "
    "WHERE t.state = 'done'"
)
# The rows benchmarks.relay_bench.prefill writes, built by the server: a million of them
# as Python dicts would take a gigabyte in this process.
PENDING_MESSAGES = sa.text(
    "INSERT INTO outbox_messages (reply_id, destination, body, content_hash, headers, state, "
    "attempts, fence, available_at, created_at) "
    "SELECT 'bench-' || n, 'default', b.body, encode(sha256(b.body), 'hex'), '{}', 'pending', "
    "0, 0, 0, :now "
    "FROM generate_series(0, :rows - 1) AS n, "
    "LATERAL (SELECT convert_to(:body_head || n || :body_tail, 'UTF8') AS body) AS b"
)
# The same rows on MariaDB, numbered by its sequence engine (seq_1_to_N, a table whose
# name holds the bounds), with no LATERAL (MariaDB has none): MySQL 8 has no such tables,
# and these figures are MariaDB's.
MYSQL_HISTORY_TASKS = (
    "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, state, "
    "attempts, max_attempts, available_at, owner, fence, result, created_at, updated_at, "
    "finished_at) "
    "SELECT SHA2(CONCAT('history-', seq), 256), 'bench-source', "
    "CONCAT(:payload_head, seq, :payload_tail), 0, :now - seq * 0.001 + 86400, 0, 'done', 1, 3, "
    ":now - seq * 0.001, 'bench-worker', 1, 'null', :now - seq * 0.001, "
    ":now - seq * 0.001 + 0.01, :now - seq * 0.001 + 0.01 "
    "FROM seq_1_to_{rows}"
)
MYSQL_HISTORY_REPLIES = sa.text(
    "INSERT INTO outbox_messages (reply_id, task_id, destination, body, content_hash, headers, "
    "state, attempts, available_at, owner, fence, last_status, created_at, sent_at) "
    "SELECT CONCAT(:reply_prefix, t.task_id), t.task_id, 'default', "
    "CONCAT(:body_head, t.task_id, :body_tail), "
    "SHA2(CONCAT(:body_head, t.task_id, :body_tail), 256), '{}', 'sent', 1, t.finished_at, "
    "'bench-relay', 1, 200, t.finished_at, t.finished_at + 0.05 "
    "FROM outbox_tasks AS t WHERE t.state = 'done'"
)
MYSQL_PENDING_MESSAGES = (
    "INSERT INTO outbox_messages (reply_id, destination, body, content_hash, headers, state, "
    "attempts, fence, available_at, created_at) "
    "SELECT CONCAT('bench-', seq), 'default', CONCAT(:body_head, seq, :body_tail), "
    "SHA2(CONCAT(:body_head, seq, :body_tail), 256), '{{}}', 'pending', 0, 0, 0, :now "
    "FROM seq_0_to_{last}"
)
MARKER = "987654321"


def on_mysql(engine: sa.Engine) -> bool:
    """Whether `engine` is on MySQL or MariaDB."""
    return engine.dialect.name in MYSQL


def around_marker(body: bytes) -> tuple[str, str]:
    """(what comes before, what comes after) MARKER in a body formatted by the product."""
    head, tail = body.decode("utf-8").split(MARKER)
    return head, tail


def add_history(url: str, rows: int) -> None:
    """Insert `rows` done tasks and their sent replies (see settle_tables for statistics)."""
    engine = outbox.create_engine(url)
    try:
        mysql = on_mysql(engine)
        tasks = sa.text(MYSQL_HISTORY_TASKS.format(rows=rows)) if mysql else HISTORY_TASKS
        replies = MYSQL_HISTORY_REPLIES if mysql else HISTORY_REPLIES
        with timed(f"history of {rows:,} done tasks and sent replies"), engine.begin() as conn:
            payload_head, payload_tail = around_marker(canonical_bytes({"n": int(MARKER)}))
            conn.execute(
                tasks,
                {
                    "rows": rows,
                    "now": time.time(),
                    "payload_head": payload_head,
                    "payload_tail": payload_tail,
                },
            )
            body_head, body_tail = around_marker(task_reply_body(TaskReply(MARKER, "done", "null")))
            conn.execute(
                replies,
                {"reply_prefix": TASK_REPLY_PREFIX, "body_head": body_head, "body_tail": body_tail},
            )
    finally:
        engine.dispose()


def settle_tables(url: str) -> None:
    """VACUUM ANALYZE, as autovacuum would have left a table that grew over months.

    Run on both sides, so that autovacuum does not wake up in the middle of one of them.
    """
    engine = outbox.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        if on_mysql(engine):  # InnoDB purges old row versions itself: statistics only
            with timed("analyze"):
                analyze(engine, "outbox_tasks", "outbox_messages")
            return
        with timed("vacuum analyze"), engine.connect() as conn:
            conn.exec_driver_sql("VACUUM ANALYZE outbox_tasks, outbox_messages")
    finally:
        engine.dispose()


def prefill_messages(url: str, rows: int) -> int:
    """Insert `rows` pending messages as publish() writes them; returns the first one's id."""
    engine = outbox.create_engine(url)
    try:
        with timed(f"prefill {rows:,} pending messages"), engine.begin() as conn:
            first = conn.execute(sa.select(sa.func.coalesce(sa.func.max(messages.c.id), 0) + 1))
            first_id = int(first.scalar_one())
            # The body relay_bench.prefill gives message n.
            body = canonical_bytes({"kind": "result", "n": int(MARKER), "payload": "x" * 64})
            head, tail = around_marker(body)
            pending = PENDING_MESSAGES
            if on_mysql(engine):
                pending = sa.text(MYSQL_PENDING_MESSAGES.format(last=rows - 1))
            conn.execute(
                pending, {"rows": rows, "now": time.time(), "body_head": head, "body_tail": tail}
            )
        analyze(engine, "outbox_messages")
    finally:
        engine.dispose()
    return first_id


# --- claim latency ------------------------------------------------------------------------


def claim_latencies(urls: dict[str, str], claims: int = CLAIMS) -> dict[str, float]:
    """Median microseconds of TaskQueue.claim (claim_many of one) on each database.

    The claims alternate between the databases, one each in turn, so that noise
    on the machine falls on every side alike.
    """
    for url in urls.values():
        prefill_tasks(url, CLAIM_WARMUP + claims)
    timings: dict[str, list[float]] = {label: [] for label in urls}
    with ExitStack() as stack, timed(f"{CLAIM_WARMUP + claims} claims on each database"):
        queues = {
            label: stack.enter_context(TaskQueue(url, lease=30)) for label, url in urls.items()
        }
        for n in range(CLAIM_WARMUP + claims):
            for label, queue in queues.items():
                started = time.perf_counter()
                claim = queue.claim("bench-claimer")
                elapsed = time.perf_counter() - started
                if claim is None:
                    raise RuntimeError(f"claim {n} found no pending task ({label})")
                # Finished, untimed: the queue stays as a live one is, nothing left running.
                queue.finish(claim, None)
                if n >= CLAIM_WARMUP:
                    timings[label].append(elapsed)
    return {label: statistics.median(times) * 1e6 for label, times in timings.items()}


# --- relay drain --------------------------------------------------------------------------


def drain_rate(url: str, total: int) -> float:
    """Messages per second relays deliver from a new backlog of `total` (history may be there)."""
    first_id = prefill_messages(url, total)
    with timed(f"drain {total:,} with {DRAIN_RELAYS} relays"):
        result = drain_backlog(url, total, "batch", DRAIN_RELAYS, DRAIN_BATCH, first_id)
    if not result["complete"]:
        raise RuntimeError(f"relays did not send all of {total}: {result}")
    return float(result["rate"])


# --- relay memory -------------------------------------------------------------------------


def status_kb(pid: int, field: str) -> int:
    """One kB figure (VmRSS, VmHWM) from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def relay_rss_while_draining(url: str, total: int) -> float:
    """Peak resident memory (MB) of one relay process while it drains `total` pending rows."""
    first_id = prefill_messages(url, total)
    engine = outbox.create_engine(url)
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            receiver_process(url, Path(tmp)) as target,
            timed(f"drain {total:,} with one relay, sampling its memory"),
            relay_processes(url, target, Path(tmp), 1, "batch", DRAIN_BATCH),
        ):
            pids = children_running("relay")
            if len(pids) != 1:
                raise RuntimeError(f"expected one relay process, found {pids}")
            peak_kb = sample_rss(engine, pids[0], time.monotonic() + DRAIN_DEADLINE_SECONDS)
        sent = sent_since(engine, first_id)
    finally:
        engine.dispose()
    if sent != total:
        raise RuntimeError(f"the relay sent {sent} of {total}")
    return peak_kb / 1024


def sample_rss(engine: sa.Engine, pid: int, deadline: float) -> int:
    """Sample VmRSS until the backlog is delivered; the peak in kB (the kernel's VmHWM too)."""
    pause = threading.Event()
    peak = 0
    next_log = time.monotonic() + 10
    while undelivered(engine):
        if time.monotonic() > deadline:
            raise RuntimeError("the relay did not drain before the deadline")
        peak = max(peak, status_kb(pid, "VmRSS"))
        if time.monotonic() > next_log:
            log(f"    relay RSS {status_kb(pid, 'VmRSS') / 1024:.0f} MB, peak {peak / 1024:.0f} MB")
            next_log += 10
        pause.wait(RSS_SAMPLE_SECONDS)
    # The high-water mark catches a peak between two samples; read it before the relay exits.
    return max(peak, status_kb(pid, "VmHWM"))


# --- one run ------------------------------------------------------------------------------


def sizes(quick: bool) -> tuple[int, int, int]:
    """(history rows, messages per drain, messages for the memory drain)."""
    return (20_000, 5_000, 5_000) if quick else (1_000_000, 100_000, 1_000_000)


def growth(
    fresh: Callable[[], AbstractContextManager[str]], history: int, drained: int, prefix: str = ""
) -> dict[str, float]:
    """Claim latency and drain rate on a database of `fresh` with no history and on one with
    `history` finished rows, as figures named with `prefix`."""
    figures: dict[str, float] = {}
    with fresh() as empty, fresh() as full:
        urls = {"empty": empty, "history": full}
        add_history(full, history)
        for url in urls.values():
            settle_tables(url)
        for label, url in urls.items():
            # Before the claims, which leave their pending replies behind.
            figures[f"{prefix}drain_rate_{label}"] = drain_rate(url, drained)
        for label, latency in claim_latencies(urls).items():
            figures[f"{prefix}claim_us_{label}"] = latency
    for label in urls:
        log(
            f"  {prefix}{label}: claim {figures[f'{prefix}claim_us_{label}']:,.0f} us, "
            f"drain {figures[f'{prefix}drain_rate_{label}']:,.0f}/s"
        )
    return figures


def run(quick: bool) -> dict[str, float]:
    """One run: claim latency and drain rate with 0 and N history rows on PostgreSQL, then
    on MySQL (figures prefixed `mysql_`), then the relay's RSS (PostgreSQL)."""
    history, drained, rss_rows = sizes(quick)
    figures: dict[str, float] = {"history_rows": history}
    figures |= growth(fresh_database, history, drained)
    figures |= growth(fresh_mysql_database, history, drained, "mysql_")
    with fresh_database() as url:
        figures["relay_rss_mb"] = relay_rss_while_draining(url, rss_rows)
    log(f"  relay peak RSS draining {rss_rows:,}: {figures['relay_rss_mb']:.0f} MB")
    return figures


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.cost_growth", run, argv)


if __name__ == "__main__":
    sys.exit(main())
