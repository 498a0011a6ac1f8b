"""Concurrency (docs/explanation/contract.md#tasks).

Independent queues (own engines) racing on one database.

Threads are released together by a Barrier; nothing sleeps. On PostgreSQL the
claims race through FOR UPDATE SKIP LOCKED, on SQLite through BEGIN IMMEDIATE.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Ack, AuthContext, Claim, Envelope, Fenced, PayloadCollision, TaskQueue, publish
from outbox.testing import ManualClock

A = AuthContext("agent-a")
TIMEOUT = 60.0
T = TypeVar("T")


@pytest.fixture
def queues(db_url: str, clock: ManualClock) -> Iterator[list[TaskQueue]]:
    """Eight queues on the test database, each with its own engine and pool."""
    made = [
        TaskQueue(db_url, clock=clock, allowed_sources=("agent-a",), tenant_cap=None)
        for _ in range(8)
    ]
    yield made
    for q in made:
        q.close()


def race(calls: list[Callable[[], T]]) -> list[T]:
    """Run the calls in threads released at once; re-raise any thread's exception."""
    barrier = threading.Barrier(len(calls), timeout=TIMEOUT)

    def released(call: Callable[[], T]) -> T:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(released, call) for call in calls]
        return [f.result(timeout=TIMEOUT) for f in futures]


def envelope(message_id: str, clock: ManualClock, payload: Any = None) -> Envelope:
    return Envelope(message_id, "agent-a", payload or {"id": message_id}, clock() + 3600)


def test_two_claimers_one_task_exactly_one_wins(
    queues: list[TaskQueue], clock: ManualClock
) -> None:
    q1, q2 = queues[:2]
    for round_ in range(50):
        tid = q1.receive(A, envelope(f"r-{round_}", clock)).task_id
        results = race([partial(q1.claim, "w1"), partial(q2.claim, "w2")])
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, (round_, results)
        [won] = winners
        assert (won.task_id, won.fence, won.attempt) == (tid, 1, 1)
        row = q1.task(tid)
        assert row is not None
        assert (row["state"], row["owner"], row["fence"], row["attempts"]) == (
            "running",
            won.owner,
            1,
            1,
        )


def test_eight_claimers_take_every_task_exactly_once(
    queues: list[TaskQueue], clock: ManualClock
) -> None:
    acks = queues[0].receive_batch(A, [envelope(f"t-{i}", clock) for i in range(100)])
    expected = sorted(a.task_id for a in acks)

    def drain(q: TaskQueue, owner: str) -> Callable[[], list[Claim]]:
        def run() -> list[Claim]:
            taken = []
            while (got := q.claim(owner)) is not None:
                taken.append(got)
            return taken

        return run

    results = race([drain(q, f"w{i}") for i, q in enumerate(queues)])
    claims = [c for taken in results for c in taken]
    assert sorted(c.task_id for c in claims) == expected  # each exactly once, none missed
    assert {c.fence for c in claims} == {1}
    for owner_index, taken in enumerate(results):
        assert all(c.owner == f"w{owner_index}" for c in taken)
    for c in claims:
        row = queues[0].task(c.task_id)
        assert row is not None
        assert (row["state"], row["owner"], row["fence"]) == ("running", c.owner, 1)


def test_claim_many_batches_never_overlap(queues: list[TaskQueue], clock: ManualClock) -> None:
    acks = queues[0].receive_batch(A, [envelope(f"t-{i}", clock) for i in range(60)])

    results = race([partial(q.claim_many, f"w{i}", 5) for i, q in enumerate(queues[:4])])
    claims = [c for batch in results for c in batch]
    assert [len(batch) for batch in results] == [5, 5, 5, 5]
    assert len({c.task_id for c in claims}) == 20
    assert {c.task_id for c in claims} <= {a.task_id for a in acks}


def test_reclaim_after_lease_expiry_has_one_winner(
    queues: list[TaskQueue], clock: ManualClock
) -> None:
    q1, q2 = queues[:2]
    for round_ in range(20):
        tid = q1.receive(A, envelope(f"r-{round_}", clock)).task_id
        first = q1.claim("first")
        assert first is not None
        assert first.task_id == tid
        clock.advance(q1.lease + 1)
        results = race([partial(q1.claim, "w1"), partial(q2.claim, "w2")])
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, (round_, results)
        assert (winners[0].task_id, winners[0].fence) == (tid, 2)
        q1.finish(winners[0], round_)  # keep one running task at a time


def test_concurrent_identical_intake_stores_one_task(
    queues: list[TaskQueue], clock: ManualClock
) -> None:
    q1, q2 = queues[:2]
    for round_ in range(20):
        env = envelope(f"dup-{round_}", clock)
        acks = race([partial(q1.receive, A, env), partial(q2.receive, A, env)])
        assert acks[0].task_id == acks[1].task_id
        assert sorted(a.duplicate for a in acks) == [False, True]
    with q1.engine.connect() as conn:
        count = conn.exec_driver_sql("SELECT count(*) FROM outbox_tasks").scalar_one()
    assert count == 20


def receive_or_collide(q: TaskQueue, env: Envelope) -> Ack | PayloadCollision:
    try:
        return q.receive(A, env)
    except PayloadCollision as exc:
        return exc


def test_concurrent_conflicting_intake_stores_one_version(
    queues: list[TaskQueue], clock: ManualClock
) -> None:
    q1, q2 = queues[:2]
    for round_ in range(20):
        envs = [envelope(f"c-{round_}", clock, {"v": 1}), envelope(f"c-{round_}", clock, {"v": 2})]
        outcomes = race(
            [partial(receive_or_collide, q, env) for q, env in zip((q1, q2), envs, strict=True)]
        )
        stored = [i for i, o in enumerate(outcomes) if isinstance(o, Ack)]
        assert len(stored) == 1, outcomes
        assert isinstance(outcomes[1 - stored[0]], PayloadCollision)
        ack = outcomes[stored[0]]
        assert isinstance(ack, Ack)
        assert not ack.duplicate
        row = q1.task(ack.task_id)
        assert row is not None
        assert row["payload"] == envs[stored[0]].payload


def test_tenant_cap_holds_under_concurrent_claims(db_url: str, clock: ManualClock) -> None:
    capped = [
        TaskQueue(db_url, clock=clock, allowed_sources=("agent-a",), tenant_cap=1) for _ in range(2)
    ]
    try:
        q1, q2 = capped
        for round_ in range(20):
            auth = AuthContext("agent-a", tenant_id=f"tenant-{round_}")
            for i in range(2):
                q1.receive(auth, envelope(f"cap-{round_}-{i}", clock))
            results = race([partial(q1.claim, "w1"), partial(q2.claim, "w2")])
            assert sum(r is not None for r in results) == 1, (round_, results)
    finally:
        for q in capped:
            q.close()


def finish_or_fenced(q: TaskQueue, held: Claim) -> str:
    try:
        q.finish(held, "finished")
    except Fenced:
        return "fenced"
    return "finished"


def test_cancel_racing_finish_leaves_exactly_one_terminal_reply(
    queues: list[TaskQueue], clock: ManualClock
) -> None:
    q1, q2 = queues[:2]
    for round_ in range(20):
        tid = q1.receive(A, envelope(f"cf-{round_}", clock)).task_id
        held = q1.claim("w1")
        assert held is not None
        cancelled, finished = race([partial(q2.cancel, tid), partial(finish_or_fenced, q1, held)])
        assert (cancelled, finished) in {(True, "fenced"), (False, "finished")}, round_
        row = q1.task(tid)
        assert row is not None
        assert row["state"] == ("cancelled" if cancelled else "done")
        replies = [r for r in q1.messages() if r["task_id"] == tid]
        assert len(replies) == 1
        assert json.loads(replies[0]["body"])["status"] == row["state"]


def publish_or_collide(engine: sa.Engine, reply_id: str, body: Any) -> int | PayloadCollision:
    with Session(engine) as session:
        try:
            row = publish(session, "billing", reply_id, body)
        except PayloadCollision as exc:
            return exc
        session.commit()
    return int(row["id"])


def test_concurrent_publish_of_one_key_stores_one_row(
    queues: list[TaskQueue], clock: ManualClock
) -> None:
    q1, q2 = queues[:2]
    for round_ in range(20):
        key = f"same-{round_}"
        ids = race(
            [
                partial(publish_or_collide, q1.engine, key, {"n": round_}),
                partial(publish_or_collide, q2.engine, key, {"n": round_}),
            ]
        )
        assert isinstance(ids[0], int)
        assert ids[0] == ids[1]
        key = f"other-{round_}"
        outcomes = race(
            [
                partial(publish_or_collide, q1.engine, key, {"v": 1}),
                partial(publish_or_collide, q2.engine, key, {"v": 2}),
            ]
        )
        assert sorted(isinstance(o, PayloadCollision) for o in outcomes) == [False, True]
    replies = q1.messages()
    assert len(replies) == 40
    assert len({r["reply_id"] for r in replies}) == 40
