"""`async def` handlers: one event loop for every slot, with the guarantees of plain ones."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool
from support.async_urls import async_url
from support.cli_helpers import one_line_error, running_in_thread
from support.worker_tasks import before_result_writes, real_time_queue, submit
from test_worker import live, states, wait_until

import outbox.asyncio
from outbox import Claim, PermanentFailure, TaskQueue, Worker
from outbox.handler_loop import WRITER_THREADS
from outbox.handlers import WrongHandlerKind
from outbox.observability.worker_metrics import WorkerMetrics


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the database clock: the worker's heartbeats run in real time."""
    yield from real_time_queue(db_url)


def test_many_handlers_wait_at_once_on_one_thread(queue: TaskQueue) -> None:
    count = 40
    ids = submit(queue, count)
    threads: set[str] = set()
    waiting = 0
    all_in: asyncio.Event | None = None

    async def handler(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
        nonlocal waiting, all_in
        threads.add(threading.current_thread().name)
        if all_in is None:
            all_in = asyncio.Event()
        waiting += 1
        if waiting == count:
            all_in.set()
        # Each returns only once every one has started: they are all running at once.
        await asyncio.wait_for(all_in.wait(), 15)
        return {"doubled": claim.payload["n"] * 2}

    before = len(live())
    worker = Worker(queue, handler, concurrency=count, poll_interval=0.05)
    with running_in_thread(worker):
        assert wait_until(lambda: states(queue, ids) == ["done"] * count)
        # Slots cost no threads: the loop, the writers, the heartbeat, the runner.
        assert len(live()) - before < 16
    assert threads == {"outbox-async-handlers"}
    results = [queue.task(task_id)["result"] for task_id in ids]  # type: ignore[index]
    assert results == [{"doubled": 2 * n} for n in range(count)]
    replies = {r["task_id"]: json.loads(r["body"])["status"] for r in queue.messages()}
    assert replies == dict.fromkeys(ids, "done")


def test_results_finishing_together_commit_together_beyond_the_writer_threads(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = 3 * WRITER_THREADS
    ids = submit(queue, count)
    batches: list[int] = []
    before_result_writes(monkeypatch, queue, lambda finished: batches.append(len(finished)))
    waiting = 0
    all_in: asyncio.Event | None = None

    async def handler(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
        nonlocal waiting, all_in
        if all_in is None:
            all_in = asyncio.Event()
        waiting += 1
        if waiting == count:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 15)  # then they all return at once
        return {"n": claim.payload["n"]}

    metrics = WorkerMetrics()
    worker = Worker(queue, handler, concurrency=count, poll_interval=0.05, metrics=metrics)
    with running_in_thread(worker):
        assert wait_until(lambda: states(queue, ids) == ["done"] * count)
        assert wait_until(lambda: f'outcome="done"}} {count}' in metrics.render().decode())
    # Results wait for their batch on the loop, not on a writer thread each.
    assert max(batches) > WRITER_THREADS, batches
    assert [queue.task(t)["result"] for t in ids] == [{"n": n} for n in range(count)]  # type: ignore[index]
    assert sorted(r["task_id"] for r in queue.messages()) == sorted(ids)


def test_a_result_that_cannot_be_stored_fails_the_task_beside_results_that_can(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = submit(queue, 4)
    calls: list[int] = []
    writes: list[list[str]] = []
    before_result_writes(
        monkeypatch, queue, lambda finished: writes.append([c.task_id for c, _ in finished])
    )
    all_in: asyncio.Event | None = None

    async def handler(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
        nonlocal all_in
        if all_in is None:
            all_in = asyncio.Event()
        calls.append(claim.payload["n"])
        if len(calls) == len(ids):
            all_in.set()
        # Each returns once every one has started: their results finish together.
        await asyncio.wait_for(all_in.wait(), 60)
        if claim.payload["n"] == 2:
            return {"value": float("nan")}  # not JSON: finish refuses it
        return {"n": claim.payload["n"]}

    with running_in_thread(Worker(queue, handler, concurrency=4, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, ids) == ["done", "done", "failed", "done"])
    assert sorted(writes[0]) == sorted(ids)  # the refused result was in the others' batch
    refused = queue.task(ids[2])
    assert refused is not None
    assert refused["last_error"].startswith("result refused:")
    assert sorted(calls) == [0, 1, 2, 3]  # each ran once


def test_results_are_written_once_the_database_answers_again(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = submit(queue, 3)
    runs: list[int] = []
    refusals = iter(range(4))

    def an_outage(finished: Any) -> None:
        if next(refusals, None) is not None:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed"), True)

    before_result_writes(monkeypatch, queue, an_outage)

    async def handler(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
        runs.append(claim.attempt)
        return {"ok": True}

    metrics = WorkerMetrics()
    worker = Worker(queue, handler, concurrency=3, poll_interval=0.05, metrics=metrics)
    with running_in_thread(worker):
        assert wait_until(lambda: states(queue, ids) == ["done"] * 3, 10)
        assert wait_until(lambda: 'outcome="done"} 3' in metrics.render().decode())
    assert runs == [1, 1, 1]  # written by the first runs, after refused writes


def test_a_slot_takes_the_next_task_while_the_last_result_waits_for_its_commit(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = submit(queue, 2)
    second_started = threading.Event()
    # Per write of the first's result: whether the second started while it was held.
    started_while_held: list[bool] = []

    def slow_write(finished: Any) -> None:
        if any(claim.task_id == first for claim, _ in finished):
            started_while_held.append(second_started.wait(15))

    before_result_writes(monkeypatch, queue, slow_write)

    async def handler(claim: Claim, stop: asyncio.Event) -> str:
        if claim.task_id == second:
            second_started.set()
        return "ok"

    # One slot: the second task can only run because the first's slot was freed when its
    # handler returned, while its result is still being committed.
    with running_in_thread(Worker(queue, handler, concurrency=1, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, [first, second]) == ["done", "done"])
    assert started_while_held[:1] == [True], "the second task waited for the first's commit"


def test_tasks_claimed_ahead_are_given_back_unrun_when_the_worker_stops(
    queue: TaskQueue,
) -> None:
    ids = submit(queue, 3)
    started: list[str] = []
    both_running, release = threading.Event(), threading.Event()

    async def handler(claim: Claim, stop: asyncio.Event) -> str:
        started.append(claim.task_id)
        if len(started) == 2:
            both_running.set()
        while not release.is_set():  # busy elsewhere until the test lets it finish
            await asyncio.sleep(0.01)
        return "ok"

    metrics = WorkerMetrics()
    # Two slots and one task claimed ahead, waiting for a slot.
    worker = Worker(queue, handler, concurrency=2, poll_interval=0.05, metrics=metrics)
    with running_in_thread(worker) as thread:
        assert both_running.wait(15)
        assert wait_until(lambda: len(worker._running) == 3)
        worker.stop()
        release.set()  # the running two finish within the grace period
        thread.join(15)
        assert not thread.is_alive()
    assert 'outcome="released"} 1' in metrics.render().decode()
    assert len(started) == 2
    [waiting] = [task_id for task_id in ids if task_id not in started]
    task = queue.task(waiting)
    assert task is not None
    assert (task["state"], task["attempts"]) == ("pending", 0)  # its attempt given back
    assert states(queue, started) == ["done", "done"]


def test_an_error_fails_the_attempt_and_a_permanent_failure_ends_the_task(
    queue: TaskQueue,
) -> None:
    flaky, broken = submit(queue, 2)

    async def handler(claim: Claim, stop: asyncio.Event) -> None:
        await asyncio.sleep(0)
        if claim.task_id == broken:
            raise PermanentFailure("bad input")
        raise RuntimeError("the service's database is down")

    with running_in_thread(Worker(queue, handler, concurrency=2, poll_interval=0.05)):
        assert wait_until(lambda: states(queue, [flaky, broken]) == ["pending", "failed"])
    retried, failed = queue.task(flaky), queue.task(broken)
    assert retried is not None
    assert failed is not None
    assert (retried["attempts"], retried["last_error"]) == (
        1,
        "RuntimeError: the service's database is down",
    )
    assert failed["last_error"] == "PermanentFailure: bad input"
    assert [r["task_id"] for r in queue.messages()] == [broken]


def test_a_handler_raising_system_exit_costs_neither_the_loop_nor_other_tasks(
    queue: TaskQueue,
) -> None:
    first, second = submit(queue, 2)

    async def handler(claim: Claim, stop: asyncio.Event) -> str:
        if claim.task_id == first:
            raise SystemExit(3)
        return "done"

    worker = Worker(queue, handler, concurrency=1, poll_interval=0.05)
    with running_in_thread(worker):
        assert wait_until(lambda: states(queue, [second]) == ["done"])
        assert wait_until(lambda: not worker._running)  # its slot was given back
    assert states(queue, [first]) == ["running"]  # left to its lease, nothing written


def test_a_refused_renewal_sets_stop_and_the_result_is_discarded(queue: TaskQueue) -> None:
    [task_id] = submit(queue, 1)
    started, stopped = threading.Event(), threading.Event()

    async def handler(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
        started.set()
        await asyncio.wait_for(stop.wait(), 15)
        stopped.set()
        return {"late": True}

    metrics = WorkerMetrics()
    worker = Worker(queue, handler, poll_interval=0.05, heartbeat=0.05, metrics=metrics)
    with running_in_thread(worker):
        assert started.wait(15)
        assert queue.cancel(task_id)
        assert stopped.wait(15)
        assert wait_until(lambda: 'outcome="discarded"} 1' in metrics.render().decode())
    task = queue.task(task_id)
    assert task is not None
    assert (task["state"], task["result"]) == ("cancelled", None)


def test_a_handler_finishing_in_its_own_transaction_is_counted_done(
    db_url: str, queue: TaskQueue, caplog: pytest.LogCaptureFixture
) -> None:
    ids = submit(queue, 3)
    with queue.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE shipments (task_id VARCHAR(64) PRIMARY KEY, n INTEGER)"))
    # No pool: its connections would belong to the worker's loop, closed before dispose().
    engine = create_async_engine(async_url(db_url), poolclass=NullPool)
    try:

        async def handler(claim: Claim, stop: asyncio.Event) -> None:
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(
                    sa.text("INSERT INTO shipments VALUES (:t, :n)"),
                    {"t": claim.task_id, "n": claim.payload["n"]},
                )
                await outbox.asyncio.finish_tx(queue, session, claim, {"shipped": True})

        metrics = WorkerMetrics()
        worker = Worker(queue, handler, concurrency=3, poll_interval=0.05, metrics=metrics)
        with caplog.at_level("WARNING", logger="outbox.worker"), running_in_thread(worker):
            assert wait_until(lambda: states(queue, ids) == ["done"] * 3)
            assert wait_until(lambda: 'outcome="done"} 3' in metrics.render().decode())
    finally:
        asyncio.run(engine.dispose())
    assert [r.getMessage() for r in caplog.records] == []
    assert [queue.task(t)["result"] for t in ids] == [{"shipped": True}] * 3  # type: ignore[index]
    with queue.engine.connect() as conn:
        shipped = conn.execute(sa.text("SELECT task_id FROM shipments ORDER BY n")).scalars()
        assert list(shipped) == ids
    assert sorted(r["task_id"] for r in queue.messages()) == sorted(ids)


def test_after_the_grace_period_late_handlers_are_cancelled_and_nothing_is_written(
    queue: TaskQueue,
) -> None:
    [task_id] = submit(queue, 1)
    started, cancelled = threading.Event(), threading.Event()

    async def handler(claim: Claim, stop: asyncio.Event) -> str:
        started.set()
        try:
            await asyncio.sleep(60)  # ignores `stop`, as badly behaved handlers do
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    worker = Worker(queue, handler, poll_interval=0.05, grace=0.2)
    with running_in_thread(worker) as thread:
        assert started.wait(15)
        worker.stop()
        thread.join(15)
        assert not thread.is_alive()
    assert cancelled.wait(15)
    task = queue.task(task_id)
    assert task is not None
    assert (task["state"], task["result"]) == ("running", None)  # left to its lease


async def _plain_async(claim: Claim, stop: asyncio.Event) -> None:
    """An async handler, to be wrapped badly."""


@functools.wraps(_plain_async)
def _careless_wrapper(claim: Claim, stop: asyncio.Event) -> Any:
    return _plain_async(claim, stop)


async def _async_generator(claim: Claim, stop: asyncio.Event) -> AsyncIterator[int]:
    yield 1


def _generator(claim: Claim, stop: threading.Event) -> Iterator[int]:
    yield 1


class _AsyncCallable:
    async def __call__(self, claim: Claim, stop: asyncio.Event) -> str:
        return "ok"


@pytest.mark.parametrize(
    ("handler", "complaint"),
    [
        (_careless_wrapper, "plain function wrapping an `async def`"),
        (_generator, "generator function"),
        (_async_generator, "generator function"),
        (_AsyncCallable, "is a class"),
        ("not a function", "is not callable"),
    ],
)
def test_a_handler_of_the_wrong_kind_is_refused_at_start(
    queue: TaskQueue, handler: Any, complaint: str
) -> None:
    with pytest.raises(WrongHandlerKind, match=complaint):
        Worker(queue, handler)


def test_partials_and_async_callables_are_async_handlers(queue: TaskQueue) -> None:
    assert Worker(queue, _AsyncCallable()).is_async
    assert Worker(queue, functools.partial(_plain_async)).is_async
    assert not Worker(queue, functools.partial(lambda claim, stop: None)).is_async


def test_a_plain_handler_returning_a_coroutine_stops_the_worker_without_failing_the_task(
    queue: TaskQueue,
) -> None:
    [task_id] = submit(queue, 1)
    # A lambda hides what it returns: found at the first call, not at start.
    worker = Worker(queue, lambda claim, stop: _plain_async(claim, stop), poll_interval=0.05)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(install_signal_handlers=False)
        except WrongHandlerKind as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(15)
    assert not thread.is_alive()
    [error] = errors
    assert "declare it `async def`" in str(error)
    task = queue.task(task_id)
    assert task is not None
    assert (task["state"], task["attempts"], task["last_error"]) == ("running", 1, None)
    assert queue.messages() == []  # no `failed` reply went out


def test_the_command_refuses_a_wrapped_async_handler_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "support.worker_handlers:wrapped_async"
    assert "wrapping an `async def`" in one_line_error(["worker", "--handler", spec], capsys)
