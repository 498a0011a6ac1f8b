"""`Worker` and `outbox worker`: results committed with replies, failures, lost leases, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.cli_helpers import one_line_error, running_in_thread
from support.processes import PROCESS_EXIT, PROCESS_START, spawned
from support.worker_tasks import before_result_writes, real_time_queue, submit, wait_until

from outbox import AuthContext, Claim, Envelope, Fenced, TaskQueue
from outbox.testing import ManualClock
from outbox.worker import PermanentFailure, Worker

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the database clock: the worker's heartbeats run in real time."""
    yield from real_time_queue(db_url)


def live() -> list[threading.Thread]:
    """The threads still running."""
    return [t for t in threading.enumerate() if t.is_alive()]


def states(queue: TaskQueue, ids: list[str]) -> list[str]:
    """Each task's state."""
    return [queue.task(task_id)["state"] for task_id in ids]  # type: ignore[index]


def test_results_commit_with_their_replies(queue: TaskQueue) -> None:
    ids = submit(queue, 5)
    seen: list[str] = []

    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        seen.append(threading.current_thread().name)
        return {"doubled": claim.payload["n"] * 2}

    with running_in_thread(Worker(queue, handler, concurrency=2, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, ids) == ["done"] * 5)
    results = [queue.task(task_id)["result"] for task_id in ids]  # type: ignore[index]
    assert results == [{"doubled": 2 * n} for n in range(5)]
    replies = {r["task_id"]: json.loads(r["body"]) for r in queue.messages()}
    assert {task_id: replies[task_id]["status"] for task_id in ids} == dict.fromkeys(ids, "done")
    assert all(name.startswith("outbox-handler") for name in seen)


def test_an_error_fails_the_attempt_and_a_permanent_failure_ends_the_task(
    queue: TaskQueue,
) -> None:
    flaky, broken = submit(queue, 2)

    def handler(claim: Claim, stop: threading.Event) -> None:
        if claim.task_id == broken:
            raise PermanentFailure("bad input")
        raise RuntimeError("database of the service is down")

    with running_in_thread(Worker(queue, handler, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, [flaky, broken]) == ["pending", "failed"])
    retried = queue.task(flaky)
    assert retried is not None
    assert retried["attempts"] == 1
    assert retried["last_error"] == "RuntimeError: database of the service is down"
    failed = queue.task(broken)
    assert failed is not None
    assert failed["last_error"] == "PermanentFailure: bad input"
    assert [r["task_id"] for r in queue.messages()] == [broken]  # the failed task's reply


def test_a_refused_renewal_stops_the_handler_and_its_result_is_discarded(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    [task_id] = submit(queue, 1)
    started, stopped = threading.Event(), threading.Event()

    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        started.set()
        if stop.wait(15):
            stopped.set()
        return {"late": True}

    finishes: list[str] = []
    before_result_writes(
        monkeypatch, queue, lambda finished: finishes.extend(c.task_id for c, _ in finished)
    )
    with running_in_thread(Worker(queue, handler, poll_interval=0.05, heartbeat=0.05)):
        assert started.wait(15)
        assert queue.cancel(task_id)
        # The next heartbeat's renewal is refused: the handler is told to stop.
        assert stopped.wait(15)
    assert finishes == []  # discarded, not even tried
    task = queue.task(task_id)
    assert task is not None
    assert (task["state"], task["result"]) == ("cancelled", None)
    [reply] = queue.messages()
    assert json.loads(reply["body"])["status"] == "cancelled"


def test_a_renewal_refused_because_the_task_just_finished_is_not_reported(
    queue: TaskQueue, caplog: pytest.LogCaptureFixture
) -> None:
    [task_id] = submit(queue, 1)
    go, renewing = threading.Event(), threading.Event()
    real_renew_many = queue.renew_many

    def handler(claim: Claim, stop: threading.Event) -> str:
        assert go.wait(15)
        return "done"

    worker = Worker(queue, handler, poll_interval=0.05, heartbeat=0.05)

    def renew_after_the_finish(claims: Sequence[Claim]) -> list[Claim | Fenced]:
        # The beat read the task as running; the result commits before its renewal lands.
        renewing.set()
        go.set()
        assert wait_until(lambda: all(r.claim.task_id != task_id for r in worker._running.held()))
        return real_renew_many(claims)

    queue.renew_many = renew_after_the_finish  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="outbox.worker"), running_in_thread(worker):
        assert renewing.wait(15)
        assert wait_until(lambda: states(queue, [task_id]) == ["done"])
    assert [r.getMessage() for r in caplog.records if "renewal refused" in r.getMessage()] == []


def test_a_handler_that_raises_system_exit_does_not_cost_the_worker_its_slot(
    queue: TaskQueue,
) -> None:
    first, second = submit(queue, 2)

    def handler(claim: Claim, stop: threading.Event) -> str:
        if claim.task_id == first:
            raise SystemExit(3)
        return "done"

    with running_in_thread(Worker(queue, handler, concurrency=1, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, [second]) == ["done"])
    assert states(queue, [first]) == ["running"]  # left to its lease, nothing written


def test_with_a_manual_clock_an_expired_lease_is_retaken_once_that_clock_says_so(
    db_url: str,
) -> None:
    clock = ManualClock(1_000_000.0)
    # A long lease: on the real clock a quarter of it would outlast the wait below.
    with TaskQueue(db_url, clock=clock, allowed_sources=("agent-a",), lease=120) as manual:
        [task_id] = submit(manual, 1)
        assert manual.claim("gone-worker") is not None
        done = threading.Event()

        def handler(claim: Claim, stop: threading.Event) -> str:
            done.set()
            return "retaken"

        worker = Worker(manual, handler, poll_interval=0.05, heartbeat=30)
        with running_in_thread(worker):
            assert wait_until(
                lambda: worker._producer is not None and worker._producer.next_reconcile > 0
            )  # its first claim ran
            clock.advance(121)  # the gone worker's lease has expired
            assert done.wait(10)
            assert wait_until(lambda: states(manual, [task_id]) == ["done"])


def test_heartbeats_keep_a_long_task_leased(queue: TaskQueue) -> None:
    [task_id] = submit(queue, 1)
    lease_ends: list[float] = []

    def handler(claim: Claim, stop: threading.Event) -> str:
        # Outlive the 2 s lease several times over, watching it move forward.
        deadline = time.monotonic() + 15
        while len(set(lease_ends)) < 3 and time.monotonic() < deadline:
            lease_ends.append(queue.task(task_id)["lease_until"])  # type: ignore[index]
            stop.wait(0.05)
        return "ok"

    with running_in_thread(Worker(queue, handler, poll_interval=0.05, heartbeat=0.2)):
        assert wait_until(lambda: states(queue, [task_id]) == ["done"])
    assert len(set(lease_ends)) >= 3
    assert lease_ends == sorted(lease_ends)


def signal_once_started(command: list[str], tmp_path: Path, first: str, signum: int) -> None:
    """Run a worker process with gated handlers; once task `first` has started, send it
    `signum` (none when 0), and once it says it is draining, release the handlers; it
    must exit 0 within PROCESS_EXIT.

    The release waits for the drain: a signal is acted on in the main thread, which
    the kernel may leave unscheduled for a while on a busy machine, and a handler
    released before then could free its slot for another claim meanwhile.
    """
    env = {**os.environ, "OUTBOXDEV_TEST_GATE": str(tmp_path), "PYTHONPATH": str(ROOT / "tests")}
    log = tmp_path / "worker.log"
    with (
        log.open("wb") as stderr,
        spawned(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr) as proc,
    ):
        # A fresh interpreter starts, claims and logs: slow on a busy machine, never hung.
        started = tmp_path / f"started-{first}"
        assert wait_until(started.exists, PROCESS_START), log.read_text()
        if signum:
            proc.send_signal(signum)

        def draining() -> bool:
            return "draining running tasks" in log.read_text()

        assert wait_until(draining, PROCESS_START), log.read_text()
        (tmp_path / "release").touch()
        proc.wait(timeout=PROCESS_EXIT)
    assert proc.returncode == 0, log.read_text()


@pytest.mark.parametrize("handler", ["gated", "async_gated"])
def test_sigterm_lets_the_running_task_finish_and_claims_nothing_more(
    db_url: str, queue: TaskQueue, tmp_path: Path, handler: str
) -> None:
    first, second = submit(queue, 2)
    command = [
        *(sys.executable, "-m", "outbox_cli", "worker", "--db", db_url),
        *("--handler", f"support.worker_handlers:{handler}", "--poll-interval", "0.05"),
    ]
    signal_once_started(command, tmp_path, first, signal.SIGTERM)
    assert states(queue, [first, second]) == ["done", "pending"]


# A Worker run by an application that keeps Python's own SIGINT handling: the interrupt is
# a KeyboardInterrupt in the thread that called run(). The child installs that handling
# itself: started from a shell in the background (`make test &`, many CI wrappers), it
# inherits SIGINT ignored, and Python then leaves it ignored.
INTERRUPTED_WORKER = """
import logging, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
logging.basicConfig(level=logging.INFO)
from outbox import TaskQueue, Worker
from support.worker_handlers import gated
with TaskQueue(sys.argv[1]) as queue:
    try:
        Worker(queue, gated, poll_interval=0.05).run(install_signal_handlers=False)
    except KeyboardInterrupt:
        sys.exit(0)
sys.exit(3)
"""


def test_an_interrupt_of_the_thread_in_run_stops_the_claims_before_the_drain(
    db_url: str, queue: TaskQueue, tmp_path: Path
) -> None:
    first, second = submit(queue, 2)
    signal_once_started(
        [sys.executable, "-c", INTERRUPTED_WORKER, db_url], tmp_path, first, signal.SIGINT
    )
    # The running task finished in the drain; the next one was never claimed.
    assert states(queue, [first, second]) == ["done", "pending"]


# A Worker whose SIGTERM the kernel hands to another thread than the one in run(): a
# thread of its own signals itself once the first task has started.
SIGNALLED_ON_ANOTHER_THREAD = """
import logging, os, pathlib, signal, sys, threading, time
logging.basicConfig(level=logging.INFO)
from outbox import TaskQueue, Worker
from support.worker_handlers import gated
gate = pathlib.Path(os.environ["OUTBOXDEV_TEST_GATE"])

def signal_this_thread() -> None:
    deadline = time.monotonic() + 60
    while not any(gate.glob("started-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=signal_this_thread, daemon=True).start()
with TaskQueue(sys.argv[1]) as queue:
    Worker(queue, gated, poll_interval=0.05).run()
"""


def test_a_sigterm_received_by_another_thread_still_stops_the_worker(
    db_url: str, queue: TaskQueue, tmp_path: Path
) -> None:
    first, _ = submit(queue, 2)
    signal_once_started(
        [sys.executable, "-c", SIGNALLED_ON_ANOTHER_THREAD, db_url], tmp_path, first, 0
    )
    assert states(queue, [first]) == ["done"]


def test_a_handler_that_cannot_be_loaded_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for spec, complaint in (
        ("no_colon", "expected module:function"),
        ("no_such_module_xyz:run", "cannot load 'no_such_module_xyz:run'"),
        ("json:no_such_function", "cannot load 'json:no_such_function'"),
    ):
        assert complaint in one_line_error(["worker", "--handler", spec], capsys)


def test_a_result_that_cannot_be_stored_fails_the_task_instead_of_running_it_again(
    queue: TaskQueue,
) -> None:
    [task_id] = submit(queue, 1)
    calls: list[int] = []

    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        calls.append(claim.attempt)
        return {"value": float("nan")}  # not JSON: finish refuses it

    with running_in_thread(Worker(queue, handler, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, [task_id]) == ["failed"])
    task = queue.task(task_id)
    assert task is not None
    assert task["last_error"].startswith("result refused:")
    assert calls == [1]


def test_after_the_grace_period_run_returns_and_a_late_outcome_is_discarded(
    queue: TaskQueue,
) -> None:
    [task_id] = submit(queue, 1)
    started, release, returned = threading.Event(), threading.Event(), threading.Event()

    def handler(claim: Claim, stop: threading.Event) -> str:
        started.set()
        release.wait(30)  # ignores `stop`, as badly behaved handlers do
        returned.set()
        return "late"

    worker = Worker(queue, handler, poll_interval=0.05, grace=0.2)
    with running_in_thread(worker) as thread:
        assert started.wait(15)
        worker.stop()
        thread.join(15)
        assert not thread.is_alive()  # run() returned though the handler has not
    release.set()
    assert returned.wait(15)
    assert wait_until(lambda: not any(t.name.startswith("outbox-handler") for t in live()))
    # Its lease is left to expire: the late result is never written.
    task = queue.task(task_id)
    assert task is not None
    assert (task["state"], task["result"]) == ("running", None)


def test_a_freed_slot_takes_the_next_task_without_waiting_for_the_poll(queue: TaskQueue) -> None:
    ids = submit(queue, 3)

    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        return {"n": claim.payload["n"]}

    # One at a time: each task must start when the last one's handler returns, not at
    # the next poll a minute later.
    with running_in_thread(Worker(queue, handler, concurrency=1, poll_interval=60)):
        assert wait_until(lambda: states(queue, ids) == ["done"] * 3, 10)


def test_an_outcome_is_written_once_the_database_answers_again(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    [task_id] = submit(queue, 1)
    runs: list[int] = []
    refusals = iter(range(4))

    def an_outage(finished: Any) -> None:
        if next(refusals, None) is not None:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed"), True)

    before_result_writes(monkeypatch, queue, an_outage)

    def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
        runs.append(claim.attempt)
        return {"ok": True}

    with running_in_thread(Worker(queue, handler, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, [task_id]) == ["done"], 10)
    assert runs == [1]  # written by the first run, after four refused writes
    assert next(refusals, None) is None  # all four were refused


def submit_named(queue: TaskQueue, name: str) -> str:
    """One task whose message id is `name`; its id."""
    envelope = Envelope(name, "agent-a", {"n": 0}, time.time() + 3600)
    return queue.receive(AuthContext("agent-a"), envelope).task_id


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_notify_wakes_an_idle_worker_without_waiting_for_the_poll(queue: TaskQueue) -> None:
    def handler(claim: Claim, stop: threading.Event) -> str:
        return "ok"

    worker = Worker(queue, handler, poll_interval=60)
    with running_in_thread(worker):
        assert worker.listening.wait(10), "worker never started listening"
        for n in range(3):
            task_id = submit_named(queue, f"woken-{n}")
            # The poll is a minute away: only NOTIFY gets this task claimed so soon.
            assert wait_until(lambda t=task_id: states(queue, [t]) == ["done"], 5)  # type: ignore[misc]
        assert worker.health()["listening"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_lost_listen_connection_is_replaced_and_wakes_the_worker_again(
    queue: TaskQueue,
) -> None:
    def handler(claim: Claim, stop: threading.Event) -> str:
        return "ok"

    def listeners() -> list[int]:
        with queue.engine.connect() as conn:
            query = (
                "SELECT pid FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN %' AND datname = current_database()"
            )
            return list(conn.execute(sa.text(query)).scalars())

    worker = Worker(queue, handler, poll_interval=60)
    with running_in_thread(worker):
        assert worker.listening.wait(10), "worker never started listening"
        [first] = listeners()
        with queue.engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        assert wait_until(lambda: listeners() not in ([], [first]), 10), "never listened again"
        task_id = submit_named(queue, "after-loss")
        assert wait_until(lambda: states(queue, [task_id]) == ["done"], 5)


def last_error(queue: TaskQueue, task_id: str) -> str | None:
    """The task's last error, if any."""
    task = queue.task(task_id)
    return None if task is None else task["last_error"]


def test_a_handler_raising_stop_iteration_fails_its_attempt(queue: TaskQueue) -> None:
    [task_id] = submit(queue, 1)

    def handler(claim: Claim, stop: threading.Event) -> str:
        return str(next(iter(())))  # an empty iterator: StopIteration

    # A future cannot hold StopIteration: without its translation the task would stay
    # running, renewed by the heartbeat, and its slot taken for good.
    with running_in_thread(Worker(queue, handler, poll_interval=0.05)):
        assert wait_until(lambda: "StopIteration" in (last_error(queue, task_id) or ""))
    task = queue.task(task_id)
    assert task is not None
    assert task["state"] in ("pending", "failed")
    assert "RuntimeError: handler raised StopIteration" in task["last_error"]
