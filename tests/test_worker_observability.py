"""The worker's metrics, health, readiness and logs: in-process and as `outbox worker`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from support.cli_helpers import running_in_thread
from support.db_faults import database_down
from support.processes import PROCESS_EXIT, PROCESS_START, reap
from support.receiver_helpers import free_port, wait_until
from support.worker_tasks import real_time_queue, submit

import outbox
from outbox import Claim, PermanentFailure, TaskQueue
from outbox.drivers import driver_for
from outbox.drivers.records import WorkerRow
from outbox.handlers import handler_name
from outbox.observability.worker_metrics import WorkerMetrics
from outbox.worker import Worker

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the database clock: the worker's heartbeats run in real time."""
    yield from real_time_queue(db_url)


def states(queue: TaskQueue, ids: list[str]) -> list[str]:
    """Each task's state."""
    return [queue.task(task_id)["state"] for task_id in ids]  # type: ignore[index]


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text: (name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def outcomes(samples: dict[Any, float]) -> dict[str, float]:
    """outbox_worker_outcomes_total by outcome, without the zeros."""
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in samples.items()
        if name == "outbox_worker_outcomes_total" and value
    }


def test_claims_outcomes_and_handler_time_are_counted(queue: TaskQueue) -> None:
    ids = submit(queue, 4)

    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        n = claim.payload["n"]
        if n == 2:
            raise RuntimeError("try again later")
        if n == 3:
            raise PermanentFailure("never")
        return {"n": n}

    metrics = WorkerMetrics()
    worker = Worker(queue, handler, concurrency=2, poll_interval=0.05, metrics=metrics)
    with running_in_thread(worker):
        wait_until(
            lambda: states(queue, ids) == ["done", "done", "pending", "failed"], 15, "outcomes"
        )
        wait_until(
            lambda: sum(outcomes(scrape(metrics.render().decode())).values()) == 4, 15, "counts"
        )
    wait_until(
        lambda: "outbox_worker_database_up 1.0" in metrics.render().decode(),
        20,
        "a scrape that reached the database",
    )
    samples = scrape(metrics.render().decode())
    assert samples["outbox_worker_claimed_total", ()] == 4.0
    assert outcomes(samples) == {"done": 2.0, "retry": 1.0, "failed": 1.0}
    assert samples["outbox_worker_handler_seconds_count", ()] == 4.0
    assert samples["outbox_worker_lease_losses_total", ()] == 0.0
    assert samples["outbox_worker_running_tasks", ()] == 0.0


def test_a_lost_lease_is_counted_and_its_outcome_discarded(queue: TaskQueue) -> None:
    [task_id] = submit(queue, 1)
    started = threading.Event()

    def handler(claim: Claim, stop: threading.Event) -> str:
        started.set()
        stop.wait(15)
        return "late"

    metrics = WorkerMetrics()
    worker = Worker(queue, handler, poll_interval=0.05, heartbeat=0.05, metrics=metrics)
    with running_in_thread(worker):
        assert started.wait(15)
        assert queue.cancel(task_id)  # the next renewal is refused
        wait_until(
            lambda: outcomes(scrape(metrics.render().decode())) == {"discarded": 1.0},
            15,
            "the outcome to be discarded",
        )
    samples = scrape(metrics.render().decode())
    assert samples["outbox_worker_lease_losses_total", ()] == 1.0


def test_without_metrics_the_worker_runs_as_before(queue: TaskQueue) -> None:
    ids = submit(queue, 2)
    worker = Worker(queue, lambda claim, stop: "ok", poll_interval=0.05)
    with running_in_thread(worker):
        wait_until(lambda: states(queue, ids) == ["done", "done"], 15, "both tasks")
    assert worker.metrics is None


def test_readiness_follows_the_database_and_liveness_does_not(db_url: str) -> None:
    engine = outbox.create_engine(db_url)
    with TaskQueue(engine, lease=2) as queue:
        metrics = WorkerMetrics()
        worker = Worker(queue, lambda claim, stop: "ok", poll_interval=0.05, metrics=metrics)
        with running_in_thread(worker):
            assert worker.readiness() == {"ok": True, "owner": worker.owner, "database": True}
            with database_down(engine):
                # The last answer is kept for a second: poll until readiness says so.
                wait_until(lambda: not worker.readiness()["ok"], 10, "not ready")
                assert worker.readiness()["database"] is False
                assert worker.health()["ok"] is True  # alive: the claim loop still turns
                text = metrics.render().decode()
                assert "outbox_worker_database_up 0.0" in text
                assert "outbox_worker_claimed_total" in text  # the counters still answer
            wait_until(lambda: worker.readiness()["ok"], 10, "ready again")
    engine.dispose()


def json_lines(err: bytes) -> list[dict[str, Any]]:
    """Every stderr line as JSON (fails on a line that is not one JSON object)."""
    lines = err.decode().splitlines()
    assert lines, "nothing logged"
    parsed = []
    for line in lines:
        entry = json.loads(line)
        assert isinstance(entry, dict), line
        parsed.append(entry)
    return parsed


def worker_command(db_url: str, *extra: str) -> list[str]:
    """`outbox worker` over the test handlers."""
    return [
        *(sys.executable, "-m", "outbox_cli", "worker", "--db", db_url),
        *("--handler", "support.worker_handlers:double_or_fail", "--poll-interval", "0.05"),
        *extra,
    ]


def test_the_worker_process_serves_metrics_and_logs_json(
    db_url: str, queue: TaskQueue, tmp_path: Path
) -> None:
    ids = submit(queue, 3)  # n = 1 fails its attempt: an error in the logs
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OUTBOX_WORKER_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        worker_command(db_url, "--metrics-port", str(port), "--owner", "w-json"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def metrics() -> dict[Any, float]:
            try:
                return scrape(httpx.get(base + "/metrics", timeout=5).text)
            except httpx.TransportError:
                return {}

        # n = 1 fails every attempt and is claimed again after each backoff (1-2 s at
        # first): on a busy machine a scrape may come after a second attempt as well.
        def first_outcomes() -> bool:
            found = outcomes(metrics())
            return found.get("done") == 2.0 and found.get("retry", 0.0) >= 1.0

        wait_until(first_outcomes, PROCESS_START, "outcomes")
        samples = metrics()
        assert set(outcomes(samples)) == {"done", "retry"}
        retries = outcomes(samples)["retry"]
        # One claim per attempt; the attempt after the last retry may be under way.
        assert samples["outbox_worker_claimed_total", ()] in (2.0 + retries, 3.0 + retries)
        done, retried, also_done = states(queue, ids)
        assert (done, also_done) == ("done", "done")
        assert retried in ("pending", "running")
        wait_until(
            lambda: metrics().get(("outbox_worker_database_up", ())) == 1.0,
            PROCESS_START,
            "the gauge",
        )
        assert httpx.get(base + "/healthz", timeout=5).status_code == 200
        ready = httpx.get(base + "/readyz", timeout=5)
        assert (ready.status_code, ready.json()["database"]) == (200, True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=PROCESS_EXIT)
        finally:
            reap(proc)
    assert proc.returncode == 0, err.decode()
    logged = json_lines(err)
    started = next(e for e in logged if e["message"].startswith("worker w-json started"))
    assert (started["owner"], started["concurrency"], started["lease"]) == ("w-json", 1, 30.0)
    assert started["handler"] == "support.worker_handlers:double_or_fail"
    assert any("odd input 1" in e["message"] for e in logged)
    stopped = logged[-1]
    assert stopped["message"] == "worker w-json stopped: drained"
    assert (stopped["drained"], stopped["abandoned"]) == (True, 0)


def test_a_worker_that_cannot_reach_its_database_says_so_in_one_json_line() -> None:
    closed = f"postgresql://postgres:pw@127.0.0.1:{free_port()}/nothing"
    result = subprocess.run(
        worker_command(closed, "--log-format", "json"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    logged = json_lines(result.stderr)
    errors = [entry for entry in logged if entry["level"] == "error"]
    assert len(errors) == 1, logged
    shown = closed.replace(":pw@", ":<redacted>@")
    assert errors[0]["message"].startswith(f"outbox: error: database {shown}: "), errors
    assert "Connection refused" in errors[0]["message"]
    assert b":pw@" not in result.stderr


def test_a_running_worker_is_announced_and_withdrawn_when_it_stops(queue: TaskQueue) -> None:
    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        return {}

    driver = driver_for(queue.engine)

    def announced() -> list[WorkerRow]:
        with queue.engine.connect() as conn:
            return driver.worker_announcements(conn)

    worker = Worker(queue, handler, owner="w-announced", concurrency=3, poll_interval=0.05)
    with running_in_thread(worker):
        wait_until(
            lambda: [row.owner for row in announced()] == ["w-announced"], 30, "the announcement"
        )
        (row,) = announced()
        assert (row.handler, row.concurrency) == (handler_name(handler), 3)
        assert row.started_at <= row.announced_at
        assert row.expires_at == pytest.approx(row.announced_at + queue.lease + worker.heartbeat)
    assert announced() == []


def test_a_heartbeat_that_fails_outside_the_database_keeps_renewing(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    renewals: list[str] = []
    renewed_after_failure = threading.Event()
    renew_many = queue.renew_many

    def flaky(claims: Any) -> Any:
        renewals.append("called")
        if len(renewals) == 1:
            # Not a database error: a pool checkout that timed out is SQLAlchemy's own.
            raise sa.exc.TimeoutError("QueuePool limit reached")
        renewed_after_failure.set()
        return renew_many(claims)

    monkeypatch.setattr(queue, "renew_many", flaky)
    [task_id] = submit(queue, 1)

    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        # Held over several heartbeats (a third of the 2 s lease each): the second beat
        # must come although the first raised.
        assert renewed_after_failure.wait(30), "the heartbeat thread stopped"
        return {}

    with running_in_thread(Worker(queue, handler, poll_interval=0.05)):
        wait_until(lambda: states(queue, [task_id]) == ["done"], 30, "the task to finish")
    assert len(renewals) >= 2
