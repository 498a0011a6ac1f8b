"""How fast `outbox console` answers each page over a large history.

Run alone: .venv/bin/python -m benchmarks.console_pages [--quick]

On a fresh PostgreSQL database: 1,000,000 rows of history (sent replies and the
finished tasks they answer, spread over the last day), 10,000 dead replies and a
small live backlog, written by INSERT ... SELECT generate_series and analyzed;
then a real `outbox console` process (asking for a token), and each page asked
for REQUESTS times over HTTP with the token, after one warm-up request. A page's
time is the client's, from the request to the last byte of the answer. Target:
every page under 200 ms (slowest_ms, the largest of the pages' medians), the
first answer of each page too (slowest_first_ms: the overview's is the first
page the console renders after it starts; only its stylesheet, the readiness check,
comes before).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from benchmarks.relay_bench import ROOT, free_port, fresh_database, log, run_alone, wait_healthy
from outbox import decisions
from outbox.dead_filter import DeadFilter
from outbox.operations import Operations

TOKEN = "benchmark-console-token-0123456789"  # noqa: S105 (a throwaway run's)
TARGET_MS = 200.0
LARGE_HISTORY = 10_000_000
"""Rows of history of the overview's large run."""
BULK_TARGET_S = 10.0
"""A bulk requeue of 10,000 dead replies, at most."""
REQUESTS = 10
DAY = 86_400.0
DESTINATIONS = 4


def pages(dead: int, middle_id: int) -> dict[str, str]:
    """(name, path) of each page timed, on rows from the middle of the seeded ones (the
    middle dead reply's message id is `middle_id`); search answers a redirect to the task's
    page."""
    middle = dead // 2
    return {
        "overview": "/",
        "dead": "/dead",
        "dead_filtered": "/dead?destination=d-1&status=410&error=gone",
        "dead_next_page": f"/dead?after={middle_id}",
        "replies_pending": "/replies?state=pending",
        "replies_sent": "/replies?state=sent",
        "replies_sent_oldest": "/replies?state=sent&order=oldest&destination=d-1",
        "tasks_done": "/tasks?state=done",
        "tasks_failed": "/tasks?state=failed",
        "reply": f"/reply?id=dead-{middle}",
        "task": f"/task?id=t-{middle}",
        "search": f"/search?q=t-{middle}",
        "audit": "/audit",
        "audit_tasks": "/audit?kind=tasks",
    }


def sizes(quick: bool) -> tuple[int, int]:
    """(history rows, dead replies): the issue's, or small ones for --quick."""
    return (20_000, 500) if quick else (1_000_000, 10_000)


def insert_finished_tasks() -> sa.TextClause:
    """:n done tasks finished over the day before :now, one every :gap seconds."""
    return sa.text(
        "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, "
        "state, attempts, max_attempts, available_at, fence, created_at, updated_at, "
        "finished_at, result) SELECT 't-' || n, 'orders-api', '{\"order\": 1}', 0, "
        ":now + 3600, 0, 'done', 1, 3, :start + n * :gap, 1, :start + n * :gap, "
        ":start + n * :gap + 0.2, :start + n * :gap + 0.2, '{\"ok\": true}' "
        "FROM generate_series(1, :n) n"
    )


REPLY_FATES = {
    # state: (task_id, attempts, sent_at, last_status, last_error)
    "sent": ("'t-' || n", "1", ":start + n * :gap + 0.5", "200", "NULL"),
    "dead": (
        "NULL",
        "5",
        "NULL",
        "CASE WHEN n % 3 = 0 THEN 410 ELSE 503 END",
        "CASE WHEN n % 3 = 0 THEN 'HTTP 410 gone' ELSE 'HTTP 503' END",
    ),
    "pending": ("NULL", "0", "NULL", "NULL", "NULL"),
}
"""The columns that differ by state: sent replies answer the task of the same number, dead
ones carry a destination's last answer."""


def insert_replies(state: str) -> sa.TextClause:
    """:n replies in `state` ('<state>-<n>') to DESTINATIONS destinations, created one every
    :gap seconds from :start."""
    task_id, attempts, sent_at, status, error = REPLY_FATES[state]
    return sa.text(
        "INSERT INTO outbox_messages (reply_id, task_id, destination, body, content_hash, "
        "headers, state, attempts, fence, available_at, created_at, sent_at, last_status, "
        f"last_error) SELECT '{state}-' || n, {task_id}, 'd-' || (n % {DESTINATIONS}), "
        f"'\\x7b7d', 'h', '{{}}', '{state}', {attempts}, 1, :start + n * :gap + 60, "
        f":start + n * :gap, {sent_at}, {status}, {error} FROM generate_series(1, :n) n"
    )


def insert_decisions() -> tuple[sa.TextClause, sa.TextClause]:
    """:n requeues of dead replies and :n cancels of tasks, one every :gap seconds from
    :start: a long audit."""
    requeues = sa.text(
        "INSERT INTO outbox_requeues (reply_id, requested_by, reason, requested_at, receipt, "
        "forced, previous_attempts, previous_status, previous_error, action) "
        "SELECT 'dead-' || n, 'ops-' || (n % 7), 'destination back', :start + n * :gap, "
        "'not received', false, 5, 503, 'HTTP 503', 'requeue' FROM generate_series(1, :n) n"
    )
    cancels = sa.text(
        "INSERT INTO outbox_task_decisions (task_id, action, requested_by, reason, "
        "requested_at) SELECT 't-' || n, 'cancel', 'ops-' || (n % 7), 'customer asked', "
        ":start + n * :gap + 0.5 FROM generate_series(1, :n) n"
    )
    return requeues, cancels


def insert_failed_attempts() -> sa.TextClause:
    """Five failed attempts of each dead reply (its attempt count): four retries, then the
    death its row holds."""
    return sa.text(
        "INSERT INTO outbox_failed_attempts (message_id, attempt, state, status, error, "
        "attempted_at) SELECT m.id, a, CASE WHEN a = 5 THEN 'dead' ELSE 'pending' END, "
        "m.last_status, m.last_error, m.created_at + a * 10 FROM outbox_messages m, "
        "generate_series(1, 5) a WHERE m.state = 'dead'"
    )


def insert_backlog_samples() -> sa.TextClause:
    """A day of the relays' samples, a minute each, of every destination."""
    return sa.text(
        "INSERT INTO outbox_backlog_samples (sampled_at, destination, backlog, oldest_age) "
        "SELECT floor(:now / 60) * 60 - m * 60, 'd-' || d, 25, 30 + m % 90 "
        f"FROM generate_series(0, 1439) m, generate_series(0, {DESTINATIONS - 1}) d"
    )


def seed(url: str, history: int, dead: int) -> int:
    """Half the history sent replies, half finished tasks; the dead replies, each with its
    failed attempts; 100 pending; as many decisions of each kind as dead replies; a day of
    backlog samples. Returns the message id of the middle dead reply (where the next page
    timed starts)."""
    engine = sa.create_engine(url)
    now = time.time()
    half = history // 2
    try:
        with engine.begin() as conn:
            window = {"now": now, "start": now - DAY, "gap": DAY / half, "n": half}
            conn.execute(insert_finished_tasks(), window)
            conn.execute(insert_replies("sent"), window)
            conn.execute(insert_replies("dead"), {**window, "gap": DAY / dead, "n": dead})
            recent = {"start": now - 100, "gap": 1.0, "n": 100}
            conn.execute(insert_replies("pending"), recent)
            requeues, cancels = insert_decisions()
            conn.execute(requeues, {**window, "gap": DAY / dead, "n": dead})
            conn.execute(cancels, {**window, "gap": DAY / dead, "n": dead})
            conn.execute(insert_failed_attempts())
            conn.execute(insert_backlog_samples(), {"now": now})
            middle_id = conn.execute(
                sa.text("SELECT id FROM outbox_messages WHERE reply_id = :reply_id"),
                {"reply_id": f"dead-{dead // 2}"},
            ).scalar_one()
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                "VACUUM ANALYZE outbox_tasks, outbox_messages, outbox_requeues, "
                "outbox_task_decisions, outbox_failed_attempts, outbox_backlog_samples"
            )
    finally:
        engine.dispose()
    return int(middle_id)


@contextmanager
def console_process(url: str, log_file: Path, token: str) -> Iterator[str]:
    """A real `outbox console` process asking for `token`; its base URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_CONSOLE_TOKEN"] = token
    with log_file.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox_cli", "console", "--db", url, "--port", str(port)],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base + "/static/console.css")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def time_pages(
    base: str, dead: int, middle_id: int, only: tuple[str, ...] | None = None
) -> dict[str, float]:
    """Median and slowest milliseconds of each page (or of those named `only`), and the
    slowest median."""
    figures: dict[str, float] = {}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
        for name, path in pages(dead, middle_id).items():
            if only is not None and name not in only:
                continue
            expected = 303 if name == "search" else 200
            spent = []
            for n in range(REQUESTS + 1):
                started = time.perf_counter()
                answer = client.get(path)
                elapsed = (time.perf_counter() - started) * 1000
                if answer.status_code != expected:
                    raise RuntimeError(f"{path} answered {answer.status_code}: {answer.text}")
                if n > 0:  # the first warms the connection pool and the compiled statements
                    spent.append(elapsed)
                else:
                    figures[f"{name}_first_ms"] = round(elapsed, 1)
            figures[f"{name}_median_ms"] = round(statistics.median(spent), 1)
            figures[f"{name}_max_ms"] = round(max(spent), 1)
    medians = [value for key, value in figures.items() if key.endswith("_median_ms")]
    figures["slowest_ms"] = max(medians)
    firsts = [value for key, value in figures.items() if key.endswith("_first_ms")]
    figures["slowest_first_ms"] = max(firsts)
    return figures


def time_bulk_requeue(url: str, dead: int) -> float:
    """Seconds to requeue every dead reply the empty filter chooses, as the console's bulk
    requeue does once confirmed (outbox.decisions, the destinations' receipt lookups
    answered "not received" in-process: asking them is the destinations' time)."""

    def nothing_received(messages: Sequence[Mapping[str, Any]]) -> list[str]:
        return ["not received"] * len(messages)

    with Operations(url) as ops:
        started = time.perf_counter()
        done = decisions.requeue(
            ops, DeadFilter(), reason="benchmark", by="bench", lookup=nothing_received
        )
        elapsed = time.perf_counter() - started
    if [d.outcome for d in done] != ["requeued"] * dead:
        raise RuntimeError(f"requeued {sum(d.outcome == 'requeued' for d in done)} of {dead}")
    return round(elapsed, 2)


def run(quick: bool) -> dict[str, Any]:
    """One run: seed, start the console, time each page; then a bulk requeue of every dead
    reply."""
    history, dead = sizes(quick)
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        middle_id = seed(url, history, dead)
        log(f"seeded {history:,} rows and {dead:,} dead in {time.monotonic() - started:.0f} s")
        with console_process(url, Path(tmp) / "console.log", TOKEN) as base:
            figures = time_pages(base, dead, middle_id)
        figures["bulk_requeue_s"] = time_bulk_requeue(url, dead)
    return {**figures, "history_rows": float(history), "dead_replies": float(dead)}


def large_size(quick: bool) -> int:
    """Rows of history of the overview's large run: the issue's, or a small one for --quick
    (beneath the console's threshold, so its counts are exact there)."""
    return 200_000 if quick else LARGE_HISTORY


def run_large(quick: bool) -> dict[str, Any]:
    """One run of the overview alone over LARGE_HISTORY rows: its final states' counts come
    from the database's statistics past the console's threshold (pages.ESTIMATE_OVER)."""
    history, dead = large_size(quick), sizes(quick)[1]
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        middle_id = seed(url, history, dead)
        log(f"seeded {history:,} rows and {dead:,} dead in {time.monotonic() - started:.0f} s")
        with console_process(url, Path(tmp) / "console.log", TOKEN) as base:
            figures = time_pages(base, dead, middle_id, only=("overview",))
    return {**figures, "history_rows": float(history)}


def main(argv: Any = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.console_pages", run, argv)


if __name__ == "__main__":
    sys.exit(main())
