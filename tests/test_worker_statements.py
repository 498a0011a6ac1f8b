"""A Worker's statements on its event loop: the producer's claims, the completer's batches of
results, and the wake-up of its producer."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Coroutine, Iterator
from functools import partial
from typing import Any, TypeVar

import psycopg
import pytest
import sqlalchemy as sa
from support.commit_windows import looking

from outbox import AuthContext, Envelope, TaskQueue
from outbox.claim import Claim
from outbox.completer import Finishes, HeldFinishes, QueueFinishes, batch_finishes
from outbox.failpoints import Crash, arm
from outbox.handler_loop import WRITER_THREADS, HandlerLoop, HandlerThreads, LoopCall, LoopWake
from outbox.producer import TaskClaims, worker_claims
from outbox.testing import ManualClock

T = TypeVar("T")
OWNER = "lane-worker"
# A result as the batch carries it: quotes, a backslash, text beyond ASCII and Latin-1.
RESULT = 'a "quoted" \\ é \u2028 \U0001f600'
only_postgresql = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)


@pytest.fixture
def loop() -> Iterator[HandlerLoop]:
    """A started HandlerLoop, closed afterwards."""
    handler_loop = HandlerLoop()
    handler_loop.start()
    yield handler_loop
    handler_loop.close(timeout=5)


@pytest.fixture
def task_claims(queue: TaskQueue, loop: HandlerLoop) -> Iterator[TaskClaims]:
    """How a Worker of `queue` would claim, closed afterwards."""
    chosen = worker_claims(queue, loop, OWNER)
    yield chosen
    on(loop, chosen.close())


@pytest.fixture
def finishes(queue: TaskQueue, loop: HandlerLoop) -> Iterator[Finishes]:
    """How a Worker of `queue` would commit a batch of results, closed afterwards."""
    chosen = batch_finishes(queue, loop)
    yield chosen
    on(loop, chosen.close())


def on(loop: HandlerLoop, coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` on the loop and return its result."""
    return loop.submit(coroutine).result(timeout=20)


def receive(queue: TaskQueue, name: str, priority: int = 0, deadline: float = 4e9) -> str:
    """One task with payload {"name": name}; its id."""
    envelope = Envelope(name, "agent-a", {"name": name}, deadline, priority=priority)
    return queue.receive(AuthContext("agent-a"), envelope).task_id


def test_postgresql_claims_and_commits_on_held_connections_and_sqlite_through_the_queue(
    backend: str, task_claims: TaskClaims, finishes: Finishes
) -> None:
    assert (task_claims.held is not None) == (backend == "postgresql")
    assert isinstance(finishes, HeldFinishes) == (backend == "postgresql")


def test_a_claim_leases_tasks_in_claim_order_as_claim_many_does(
    queue: TaskQueue,
    loop: HandlerLoop,
    task_claims: TaskClaims,
    finishes: Finishes,
    clock: ManualClock,
) -> None:
    low, high = receive(queue, "low", priority=0), receive(queue, "high", priority=5)
    claims = on(loop, task_claims.claim(10, reconcile=False))
    assert [c.task_id for c in claims] == [high, low]
    assert [(c.owner, c.fence, c.attempt) for c in claims] == [(OWNER, 1, 1)] * 2
    assert [c.payload for c in claims] == [{"name": "high"}, {"name": "low"}]
    assert [c.lease_until for c in claims] == [clock() + queue.lease] * 2
    for claim in claims:
        task = queue.task(claim.task_id)
        assert task is not None
        assert (task["state"], task["owner"], task["fence"]) == ("running", OWNER, 1)
    assert on(loop, task_claims.claim(10, reconcile=False)) == []


def test_a_claim_takes_at_most_its_limit(
    queue: TaskQueue, loop: HandlerLoop, task_claims: TaskClaims, finishes: Finishes
) -> None:
    for n in range(5):
        receive(queue, f"t{n}")
    assert len(on(loop, task_claims.claim(3, reconcile=False))) == 3
    assert len(on(loop, task_claims.claim(3, reconcile=False))) == 2


def test_a_reconciling_claim_takes_back_an_expired_lease_first(
    queue: TaskQueue,
    loop: HandlerLoop,
    task_claims: TaskClaims,
    finishes: Finishes,
    clock: ManualClock,
) -> None:
    task_id = receive(queue, "t")
    [first] = on(loop, task_claims.claim(1, reconcile=False))
    clock.advance(queue.lease + 1)
    assert on(loop, task_claims.claim(1, reconcile=False)) == []  # not reconciled: still running
    [again] = on(loop, task_claims.claim(1, reconcile=True))
    assert (again.task_id, again.fence, again.attempt) == (task_id, first.fence + 1, 2)


def test_results_commit_with_their_replies_and_stale_claims_are_refused(
    queue: TaskQueue, loop: HandlerLoop, task_claims: TaskClaims, finishes: Finishes
) -> None:
    for name in ("a", "b", "c"):
        receive(queue, name)
    a, b, c = on(loop, task_claims.claim(3, reconcile=False))
    stale = Claim(b.task_id, b.owner, b.fence + 7, b.attempt, b.payload)
    written = on(
        loop, finishes.finish([(a, {"r": RESULT}), (stale, {"r": "stale"}), (c, float("nan"))])
    )
    assert written == [True, False, False]  # a stale fence; a result that is not JSON
    states = {t: queue.task(t)["state"] for t in (a.task_id, b.task_id, c.task_id)}  # type: ignore[index]
    assert states == {a.task_id: "done", b.task_id: "running", c.task_id: "running"}
    assert queue.task(a.task_id)["result"] == {"r": RESULT}  # type: ignore[index]
    [reply] = queue.messages()
    assert reply["task_id"] == a.task_id
    assert json.loads(reply["body"]) == {
        "kind": "result",
        "result": {"r": RESULT},
        "status": "done",
        "task_id": a.task_id,
    }
    assert reply["content_hash"] == hashlib.sha256(reply["body"]).hexdigest()
    # Written once: a second finish of the same claim changes nothing.
    assert on(loop, finishes.finish([(a, {"r": "again"})])) == [False]
    assert len(queue.messages()) == 1


def test_of_two_claims_of_one_task_in_a_batch_only_the_newer_is_written(
    queue: TaskQueue,
    loop: HandlerLoop,
    task_claims: TaskClaims,
    finishes: Finishes,
    clock: ManualClock,
) -> None:
    receive(queue, "t")
    [old] = on(loop, task_claims.claim(1, reconcile=False))
    clock.advance(queue.lease + 1)
    [new] = on(loop, task_claims.claim(1, reconcile=True))
    assert on(loop, finishes.finish([(old, "old"), (new, "new")])) == [False, True]
    assert queue.task(new.task_id)["result"] == "new"  # type: ignore[index]


@only_postgresql
@pytest.mark.parametrize(
    ("point", "claimed", "state"),
    [
        ("claim.before_commit", False, "pending"),
        ("claim.after_commit", True, "running"),
    ],
)
def test_a_claim_passes_its_failpoints_around_the_statement(
    queue: TaskQueue,
    loop: HandlerLoop,
    task_claims: TaskClaims,
    finishes: Finishes,
    point: str,
    claimed: bool,
    state: str,
) -> None:
    task_id = receive(queue, "t")
    with arm(point), pytest.raises(Crash):
        on(loop, task_claims.claim(1, reconcile=False))
    assert queue.task(task_id)["state"] == state  # type: ignore[index]
    assert len(on(loop, task_claims.claim(1, reconcile=False))) == (0 if claimed else 1)


@only_postgresql
@pytest.mark.parametrize(
    ("point", "state"), [("finish.before_commit", "running"), ("finish.after_commit", "done")]
)
def test_a_finish_passes_its_failpoints_around_the_statement(
    queue: TaskQueue,
    loop: HandlerLoop,
    task_claims: TaskClaims,
    finishes: Finishes,
    point: str,
    state: str,
) -> None:
    receive(queue, "t")
    [claim] = on(loop, task_claims.claim(1, reconcile=False))
    with arm(point), pytest.raises(Crash):
        on(loop, finishes.finish([(claim, "ok")]))
    assert queue.task(claim.task_id)["state"] == state  # type: ignore[index]
    assert len(queue.messages()) == (1 if state == "done" else 0)


@only_postgresql
@pytest.mark.parametrize(
    ("point", "written"),
    [
        ("claim.before_commit", {"outbox_tasks"}),
        ("finish.before_commit", {"outbox_tasks", "outbox_messages"}),
    ],
)
def test_a_lane_reaches_its_before_commit_failpoint_with_the_writes_held(
    queue: TaskQueue,
    loop: HandlerLoop,
    task_claims: TaskClaims,
    finishes: Finishes,
    point: str,
    written: set[str],
) -> None:
    # The lane commits one autocommit statement; armed, it runs it in a transaction.
    task_id = receive(queue, "t")
    claims: list[Claim] = []
    if point == "finish.before_commit":
        claims = on(loop, task_claims.claim(1, reconcile=False))
    step = finishes.finish([(claims[0], "ok")]) if claims else task_claims.claim(1, reconcile=False)
    with looking(queue.engine, point) as seen, pytest.raises(Crash):
        on(loop, step)
    [found] = seen
    assert written <= found.written, found
    assert queue.task(task_id)["state"] == ("running" if claims else "pending")  # type: ignore[index]
    assert queue.messages() == []


@only_postgresql
def test_a_lane_whose_connection_was_cut_raises_once_then_connects_again(
    queue: TaskQueue, loop: HandlerLoop, task_claims: TaskClaims, finishes: Finishes
) -> None:
    receive(queue, "t")
    assert on(loop, task_claims.claim(1, reconcile=False)) != []  # the claim lane is connected
    with queue.engine.connect() as conn:
        cut = conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND query LIKE 'WITH picked AS MATERIALIZED%'"
            )
        ).all()
    assert cut == [(True,)]
    receive(queue, "u")
    with pytest.raises(psycopg.OperationalError):
        on(loop, task_claims.claim(1, reconcile=False))
    [claim] = on(loop, task_claims.claim(1, reconcile=False))
    assert claim.payload == {"name": "u"}


@only_postgresql
def test_a_closed_lane_refuses_statements(
    queue: TaskQueue, loop: HandlerLoop, task_claims: TaskClaims, finishes: Finishes
) -> None:
    receive(queue, "a1")
    (claim,) = on(loop, task_claims.claim(1, reconcile=False))
    on(loop, task_claims.close())
    with pytest.raises(RuntimeError, match="closed"):
        on(loop, task_claims.claim(1, reconcile=False))
    if isinstance(finishes, HeldFinishes):  # SQLite's batches are the queue's own
        on(loop, finishes.close())
        with pytest.raises(RuntimeError, match="closed"):
            on(loop, finishes.finish([(claim, "ok")]))


def test_a_capped_queue_claims_within_the_cap(db_url: str, loop: HandlerLoop) -> None:
    with TaskQueue(db_url, allowed_sources=("agent-a",), tenant_cap=1) as queue:
        receive(queue, "a1")
        receive(queue, "a2")
        capped = worker_claims(queue, loop, OWNER)
        try:
            assert len(on(loop, capped.claim(10, reconcile=False))) == 1
        finally:
            on(loop, capped.close())


# --- LoopWake -------------------------------------------------------------------------------


def test_a_wake_set_from_other_threads_reaches_the_waiter_once(loop: HandlerLoop) -> None:
    wake = LoopWake(loop)
    setters = [threading.Thread(target=wake.set) for _ in range(20)]
    for setter in setters:
        setter.start()
    for setter in setters:
        setter.join()

    async def wait_twice() -> tuple[bool, bool]:
        started = loop.loop.time()
        await wake.wait(10)  # the sets above: at once
        woken = loop.loop.time()
        await wake.wait(0.05)  # nothing more was set: the timeout
        return woken - started < 5, loop.loop.time() - woken >= 0.04

    assert on(loop, wait_twice()) == (True, True)


def test_requests_made_while_a_call_is_queued_fold_into_it(loop: HandlerLoop) -> None:
    calls: list[int] = []
    call = LoopCall(loop.loop, lambda: calls.append(1))
    busy, release = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        busy.set()
        release.wait(10)

    loop.loop.call_soon_threadsafe(hold_the_loop)
    assert busy.wait(10)
    for _ in range(5):
        call.request()
    release.set()
    on(loop, asyncio.sleep(0))  # queued after the call: it has run by then
    assert calls == [1]
    call.request()  # not queued any more: a new call
    on(loop, asyncio.sleep(0))
    assert calls == [1, 1]


def test_handler_threads_answer_every_call_that_returned_while_the_loop_was_busy(
    loop: HandlerLoop,
) -> None:
    threads = HandlerThreads(loop, 3)
    returned = threading.Semaphore(0)

    def answer(value: int) -> int:
        returned.release()
        if value < 0:
            raise ValueError(value)
        return value

    async def three_calls_on_a_held_loop() -> list[Any]:
        calls = [asyncio.ensure_future(threads.run(partial(answer, n))) for n in (1, 2, -3)]
        await asyncio.sleep(0)  # the calls are queued to the threads
        for _ in calls:  # the loop is held while all three return
            assert returned.acquire(timeout=10)
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        one, two, failed = on(loop, three_calls_on_a_held_loop())
    finally:
        threads.close()
    assert (one, two) == (1, 2)
    assert isinstance(failed, ValueError)
    assert failed.args == (-3,)


def test_a_wake_set_on_the_loop_wakes_a_waiting_coroutine(loop: HandlerLoop) -> None:
    wake = LoopWake(loop)

    async def woken() -> bool:
        loop.loop.call_soon(wake.set)
        started = loop.loop.time()
        await wake.wait(10)
        return loop.loop.time() - started < 5

    assert on(loop, woken())


def test_a_queue_on_the_callers_engine_claims_and_commits_through_the_queue(
    db_url: str, loop: HandlerLoop
) -> None:
    # Its connection settings may live outside its URL (connect_args, a creator).
    engine = sa.create_engine(sa.make_url(db_url))
    try:
        with TaskQueue(engine) as queue:
            chosen = worker_claims(queue, loop, OWNER)
            assert chosen.held is None
            on(loop, chosen.close())
            assert type(batch_finishes(queue, loop)) is QueueFinishes
    finally:
        engine.dispose()


def test_a_threaded_claim_does_not_wait_behind_busy_writer_threads(
    queue: TaskQueue, loop: HandlerLoop, task_claims: TaskClaims, finishes: Finishes
) -> None:
    task_id = receive(queue, "t")
    release = threading.Event()

    async def writers_held_and_a_claim() -> list[str]:
        held = [loop.write(partial(release.wait, 15)) for _ in range(WRITER_THREADS)]
        pending = [asyncio.ensure_future(h) for h in held]
        try:
            # Reconciling: a claim that always goes through TaskQueue on a thread.
            claims = await asyncio.wait_for(task_claims.claim(1, reconcile=True), 10)
        finally:
            release.set()
            await asyncio.gather(*pending)
        return [c.task_id for c in claims]

    assert on(loop, writers_held_and_a_claim()) == [task_id]


@only_postgresql
def test_the_claims_connections_run_without_sorts_and_the_pool_keeps_its_settings(
    queue: TaskQueue, loop: HandlerLoop, task_claims: TaskClaims
) -> None:
    # The task claim walks ix_outbox_tasks_claimable only while sorts are off on the
    # connection it runs on (tests/test_claim_plans.py).
    receive(queue, "t")
    assert len(on(loop, task_claims.claim(1, reconcile=False))) == 1
    assert task_claims.held is not None

    async def held_setting() -> str:
        async with task_claims.held._lane.connection() as conn:  # type: ignore[union-attr]
            row = await (await conn.execute("SHOW enable_sort")).fetchone()
        assert row is not None
        return str(row[0])

    assert on(loop, held_setting()) == "off"
    assert queue.claim_many("w", 1) == []
    with queue._claims.connection() as conn:
        assert conn.exec_driver_sql("SHOW enable_sort").scalar() == "off"
    with queue.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW enable_sort").scalar() == "on"


@only_postgresql
def test_a_claim_on_a_stand_in_for_the_busy_claims_lane_runs_without_sorts(
    queue: TaskQueue,
) -> None:
    # The claim's plan needs the claims' setting on the connection it runs on, held or
    # pooled; read there, just before the claim statement runs.
    receive(queue, "t")
    seen: list[str] = []

    def setting_of_the_claim(conn: sa.Connection, cursor: Any, statement: str, *rest: Any) -> None:
        if "picked" in statement and "outbox_tasks" in statement:
            probe = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                probe.execute("SHOW enable_sort")
                seen.append(probe.fetchone()[0])
            finally:
                probe.close()

    sa.event.listen(queue.engine, "before_cursor_execute", setting_of_the_claim)
    try:
        with queue._claims.connection() as held:  # busy: the claim takes a stand-in
            [claim] = queue.claim_many("w", 1, reconcile=False)
            assert held.exec_driver_sql("SHOW enable_sort").scalar() == "off"
    finally:
        sa.event.remove(queue.engine, "before_cursor_execute", setting_of_the_claim)
    assert claim.owner == "w"
    assert seen == ["off"]
    with queue.engine.connect() as first, queue.engine.connect() as second:
        for pooled in (first, second):
            assert pooled.exec_driver_sql("SHOW enable_sort").scalar() == "on"
