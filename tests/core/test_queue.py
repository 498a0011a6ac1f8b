"""Task queue conformance (docs/explanation/contract.md#tasks).

Claims, leases, fencing, retries, replies.

Time only moves through the ManualClock; every terminal path must leave exactly
one reply whose body is the canonical result document.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import AuthContext, Claim, Envelope, Fenced, InvalidMessage, TaskQueue, task_results
from outbox.canonical import MAX_DEPTH, MAX_NODES
from outbox.drivers import DRIVERS
from outbox.task_cancel import MAX_REASON_CHARS
from outbox.tasks import RECONCILE_BATCH
from outbox.testing import ManualClock

A = AuthContext("agent-a")
B = AuthContext("agent-b")
LEASE = 10.0  # the queue fixture's default lease

MakeQueue = Callable[..., TaskQueue]


# --- helpers -----------------------------------------------------------------


class EdgeRng(random.Random):
    """A stand-in RNG that returns an edge of every uniform(a, b) and records the bounds."""

    def __init__(self, pick: str) -> None:
        super().__init__(0)
        self.pick = pick
        self.calls: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return a if self.pick == "low" else b


@pytest.fixture
def make_queue(db_url: str, clock: ManualClock) -> Iterator[MakeQueue]:
    """Build extra queues on the test database (same clock); all are closed at the end."""
    made: list[TaskQueue] = []

    def make(**options: Any) -> TaskQueue:
        options.setdefault("allowed_sources", ("agent-a", "agent-b"))
        q = TaskQueue(db_url, clock=clock, **options)
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()


def submit(
    queue: TaskQueue,
    clock: ManualClock,
    message_id: str,
    *,
    auth: AuthContext = A,
    deadline_in: float = 3600.0,
    **fields: Any,
) -> str:
    payload = fields.pop("payload", {"id": message_id})
    env = Envelope(message_id, auth.principal, payload, clock() + deadline_in, **fields)
    ack = queue.receive(auth, env)
    assert not ack.duplicate
    return ack.task_id


def task(queue: TaskQueue, task_id: str) -> dict[str, Any]:
    row = queue.task(task_id)
    assert row is not None
    return row


def claim(queue: TaskQueue, owner: str = "w") -> Claim:
    got = queue.claim(owner)
    assert got is not None
    return got


def canonical(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def replies_for(queue: TaskQueue, task_id: str) -> list[dict[str, Any]]:
    return [r for r in queue.messages() if r["task_id"] == task_id]


DEADLINE_PASSED = ("deadline_passed", "deadline passed")
CANCELLED = ("cancelled", "cancelled")


def assert_one_reply(
    queue: TaskQueue,
    task_id: str,
    status: str,
    result: Any = None,
    error: tuple[str, str] | None = None,
) -> None:
    """Exactly one reply for the task, with the canonical terminal body; `error` is
    (code, reason), required for every status but done."""
    assert (status == "done") == (error is None), (status, error)
    replies = replies_for(queue, task_id)
    assert len(replies) == 1, replies
    [reply] = replies
    expected: dict[str, Any] = {
        "kind": "result",
        "task_id": task_id,
        "status": status,
        "result": result,
    }
    if error is not None:
        expected["error"] = {"code": error[0], "reason": error[1]}
    body = canonical(expected)
    assert reply["reply_id"] == "reply:" + task_id
    assert reply["body"] == body
    assert reply["content_hash"] == hashlib.sha256(body).hexdigest()
    assert reply["destination"] == "default"


def assert_fenced_everywhere(queue: TaskQueue, stale: Claim) -> None:
    """renew, finish and fail by a stale holder all raise Fenced and change nothing."""
    before_task, before_replies = queue.task(stale.task_id), queue.messages()
    with pytest.raises(Fenced):
        queue.renew(stale)
    with pytest.raises(Fenced):
        queue.finish(stale, {"stale": True})
    with pytest.raises(Fenced):
        queue.fail(stale, "stale failure")
    with pytest.raises(Fenced):
        queue.fail(stale, "stale failure", permanent=True)
    assert queue.task(stale.task_id) == before_task
    assert queue.messages() == before_replies


# --- claiming ------------------------------------------------------------------


def test_claim_on_an_empty_queue_returns_none(queue: TaskQueue) -> None:
    assert queue.claim("w") is None
    assert queue.claim_many("w", 5) == []


def test_claim_sets_running_owner_fence_attempt_and_lease(
    queue: TaskQueue, clock: ManualClock
) -> None:
    tid = submit(queue, clock, "m-1", payload={"job": [1, 2]})
    t0 = clock()
    got = claim(queue, "worker-1")
    assert got == Claim(
        task_id=tid,
        owner="worker-1",
        fence=1,
        attempt=1,
        payload={"job": [1, 2]},
        lease_until=t0 + LEASE,
        deadline=t0 + 3600,
    )
    row = task(queue, tid)
    assert (row["state"], row["owner"], row["fence"], row["attempts"], row["lease_until"]) == (
        "running",
        "worker-1",
        1,
        1,
        t0 + LEASE,
    )
    assert queue.claim("worker-2") is None
    assert queue.messages() == []


def submit_apart(queue: TaskQueue, clock: ManualClock, count: int) -> list[str]:
    """`count` tasks received a second apart: no order is promised among ties."""
    ids = []
    for i in range(count):
        ids.append(submit(queue, clock, f"m-{i}"))
        clock.advance(1)
    return ids


def test_claim_takes_exactly_one_task(queue: TaskQueue, clock: ManualClock) -> None:
    ids = submit_apart(queue, clock, 4)
    got = claim(queue)
    assert got.task_id == ids[0]
    assert [task(queue, tid)["state"] for tid in ids] == ["running"] + ["pending"] * 3
    assert [task(queue, tid)["attempts"] for tid in ids] == [1, 0, 0, 0]


def test_claim_many_takes_at_most_limit_tasks(queue: TaskQueue, clock: ManualClock) -> None:
    ids = submit_apart(queue, clock, 6)
    got = queue.claim_many("w", 4)
    assert [c.task_id for c in got] == ids[:4]
    assert [task(queue, tid)["state"] for tid in ids] == ["running"] * 4 + ["pending"] * 2


def test_lease_length_is_configurable(make_queue: MakeQueue, clock: ManualClock) -> None:
    q = make_queue(lease=25)
    submit(q, clock, "m-1")
    assert claim(q).lease_until == clock() + 25


@pytest.mark.parametrize("mode", ["one-by-one", "claim_many"])
def test_claim_order_is_priority_then_available_at_then_created(
    make_queue: MakeQueue, clock: ManualClock, mode: str
) -> None:
    q = make_queue(rng=EdgeRng("high"))  # a failed first attempt is due again at +2 s exactly
    t0 = clock()
    old = submit(q, clock, "old")  # created at t0
    assert q.fail(claim(q), "transient") == "pending"
    assert task(q, old)["available_at"] == t0 + 2
    clock.advance(0.5)
    low = submit(q, clock, "low", priority=-1)  # created t0+0.5, lowest priority
    clock.advance(0.5)
    mid = submit(q, clock, "mid")  # created t0+1, due t0+1: due before `old`
    clock.advance(1)
    new = submit(q, clock, "new")  # created t0+2, due t0+2: ties with `old`, created later
    clock.advance(1)
    high = submit(q, clock, "high", priority=5)  # created last, highest priority
    expected = [high, mid, old, new, low]
    if mode == "claim_many":
        got = [c.task_id for c in q.claim_many("w", 10)]
    else:
        got = [claim(q).task_id for _ in expected]
        assert q.claim("w") is None
    assert got == expected


def test_available_at_in_the_future_is_not_claimable_until_reached(
    make_queue: MakeQueue, clock: ManualClock
) -> None:
    q = make_queue(rng=EdgeRng("low"))  # first retry due at +1 s exactly
    tid = submit(q, clock, "m-1")
    q.fail(claim(q), "transient")
    assert task(q, tid)["available_at"] == clock() + 1
    assert q.claim("w") is None
    clock.advance(0.5)
    assert q.claim("w") is None
    clock.advance(0.5)
    again = claim(q)
    assert (again.task_id, again.fence, again.attempt) == (tid, 2, 2)


def test_renew_extends_the_lease(queue: TaskQueue, clock: ManualClock) -> None:
    tid = submit(queue, clock, "m-1")
    first = claim(queue)
    clock.advance(6)
    renewed = queue.renew(first)
    assert renewed.lease_until == clock() + LEASE
    assert (renewed.task_id, renewed.owner, renewed.fence, renewed.attempt) == (
        first.task_id,
        first.owner,
        first.fence,
        first.attempt,
    )
    assert task(queue, tid)["lease_until"] == clock() + LEASE
    clock.advance(6)  # past the first lease, inside the renewed one
    assert queue.reconcile()["requeued"] == 0
    assert queue.claim("other") is None
    queue.finish(renewed, "ok")
    assert task(queue, tid)["state"] == "done"
    assert_one_reply(queue, tid, "done", "ok")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_renewal_is_a_hot_update(queue: TaskQueue, clock: ManualClock) -> None:
    """No index names what a renewal changes, and pages keep room: no new index entries."""
    for n in range(5):
        submit(queue, clock, f"m-{n}")
    held = [(c.task_id, c.owner, c.fence) for c in queue.claim_many("w", 5)]
    # This backend's counts not yet reported (PostgreSQL 15 keeps earlier transactions'
    # until it reports them): what the renewals add is the difference.
    counts = sa.text(
        "SELECT pg_stat_get_xact_tuples_updated(CAST('outbox_tasks' AS regclass)), "
        "pg_stat_get_xact_tuples_hot_updated(CAST('outbox_tasks' AS regclass))"
    )
    with queue._engine.begin() as conn:
        updated_before, hot_before = conn.execute(counts).one()
        for beat in range(3):
            clock.advance(1)
            assert len(DRIVERS["postgresql"].renew_leases(conn, held, LEASE, clock())) == 5, beat
        updated, hot = conn.execute(counts).one()
    assert (updated - updated_before, hot - hot_before) == (15, 15)


def test_renew_many_renews_the_held_and_says_why_each_other_is_not(
    queue: TaskQueue, clock: ManualClock
) -> None:
    """A heartbeat's one statement: held leases extended, lost ones left as they are."""
    held, stolen, finished = (submit(queue, clock, f"m-{n}") for n in range(3))
    claims = {c.task_id: c for c in queue.claim_many("w1", 3)}
    clock.advance(LEASE)  # every lease lapsed; w2 takes over one of them
    queue.reconcile()
    taken = {c.task_id: c for c in queue.claim_many("w2", 3)}
    assert set(taken) == {held, stolen, finished}
    queue.finish(taken[finished], "by w2")
    renewing = [taken[held], claims[stolen], taken[finished]]
    clock.advance(1)
    answers = queue.renew_many(renewing)
    assert isinstance(answers[0], Claim)
    assert answers[0].lease_until == clock() + LEASE
    assert answers[0] == dataclasses.replace(renewing[0], lease_until=clock() + LEASE)
    assert isinstance(answers[1], Fenced)
    assert "held by 'w2' under fence 2" in str(answers[1])
    assert isinstance(answers[2], Fenced)
    assert "task is done" in str(answers[2])
    # The lost claim's task keeps its new holder's lease.
    assert task(queue, stolen)["lease_until"] == taken[stolen].lease_until
    assert task(queue, held)["lease_until"] == clock() + LEASE
    assert queue.renew_many([]) == []


def test_renew_many_answers_each_claim_of_a_task_held_twice_by_its_fence(
    queue: TaskQueue, clock: ManualClock
) -> None:
    """A worker may hold a task lost and claimed again under two fences at once: only the
    newer claim is renewed; the older one is Fenced, not renewed by its twin's row."""
    tid = submit(queue, clock, "m-1")
    stale = claim(queue, "w1")
    clock.advance(LEASE)
    queue.reconcile()
    fresh = claim(queue, "w1")
    assert (fresh.task_id, fresh.fence) == (tid, stale.fence + 1)
    clock.advance(1)
    old, new = queue.renew_many([stale, fresh])
    assert isinstance(old, Fenced)
    assert f"under fence {fresh.fence}" in str(old)
    assert isinstance(new, Claim)
    assert (new.fence, new.lease_until) == (fresh.fence, clock() + LEASE)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_renew_many_skips_a_row_locked_by_a_write_under_way(
    queue: TaskQueue, clock: ManualClock, db_url: str
) -> None:
    """A heartbeat never waits on a row its own finish is writing (two multi-row statements
    waiting on each other would deadlock): that claim comes back still held, unextended."""
    busy, free = (submit(queue, clock, f"m-{n}") for n in range(2))
    claims = {c.task_id: c for c in queue.claim_many("w1", 2)}
    clock.advance(5)
    engine = sa.create_engine(sa.make_url(db_url).set(drivername="postgresql+psycopg"))
    try:
        with engine.connect() as locker:
            locker.exec_driver_sql(
                "SELECT 1 FROM outbox_tasks WHERE task_id = %(t)s FOR UPDATE", {"t": busy}
            )
            answers: list[Claim | Fenced] = []
            renewing = threading.Thread(
                target=lambda: answers.extend(queue.renew_many([claims[busy], claims[free]]))
            )
            renewing.start()
            renewing.join(timeout=15)
            waited = renewing.is_alive()
            locker.rollback()  # lets a renewal that waited go on, so the test ends
            renewing.join()
    finally:
        engine.dispose()
    assert not waited, "renew_many waited for the locked row"
    kept, renewed = answers
    assert isinstance(kept, Claim)
    assert isinstance(renewed, Claim)
    assert kept.lease_until == claims[busy].lease_until  # held, not extended this beat
    assert renewed.lease_until == clock() + LEASE
    assert task(queue, busy)["lease_until"] == claims[busy].lease_until


def test_old_claim_object_still_works_after_renew(queue: TaskQueue, clock: ManualClock) -> None:
    """Renewal keeps owner and fence: the claim held before the heartbeat is still valid."""
    tid = submit(queue, clock, "m-1")
    first = claim(queue)
    clock.advance(8)
    queue.renew(first)
    clock.advance(8)
    queue.finish(first, 1)
    assert_one_reply(queue, tid, "done", 1)


def test_lease_ends_at_lease_until_for_worker_and_reclaimer_alike(
    queue: TaskQueue, clock: ManualClock
) -> None:
    tid = submit(queue, clock, "m-1")
    first = claim(queue, "w1")
    clock.advance(LEASE)  # now == lease_until
    with pytest.raises(Fenced):
        queue.renew(first)
    second = claim(queue, "w2")
    assert (second.task_id, second.fence) == (tid, 2)


def test_claim_before_lease_expiry_does_not_steal(queue: TaskQueue, clock: ManualClock) -> None:
    tid = submit(queue, clock, "m-1")
    first = claim(queue, "w1")
    clock.advance(LEASE - 0.5)
    assert queue.claim("w2") is None
    assert queue.reconcile() == {"expired": 0, "requeued": 0, "failed": 0, "messages_requeued": 0}
    row = task(queue, tid)
    assert (row["state"], row["owner"], row["fence"]) == ("running", "w1", 1)
    queue.finish(first, None)
    assert_one_reply(queue, tid, "done")


@pytest.mark.parametrize("via", ["reconcile", "claim"])
def test_expired_lease_is_reclaimed_with_a_higher_fence(
    queue: TaskQueue, clock: ManualClock, via: str
) -> None:
    tid = submit(queue, clock, "m-1")
    stale = claim(queue, "w1")
    clock.advance(LEASE + 1)
    if via == "reconcile":
        assert queue.reconcile() == {
            "expired": 0,
            "requeued": 1,
            "failed": 0,
            "messages_requeued": 0,
        }
        row = task(queue, tid)
        assert (row["state"], row["lease_until"], row["last_error"]) == (
            "pending",
            None,
            "lease expired",
        )
        assert row["available_at"] <= clock()
    fresh = claim(queue, "w2")
    assert (fresh.task_id, fresh.owner, fresh.fence, fresh.attempt) == (tid, "w2", 2, 2)
    assert fresh.lease_until == clock() + LEASE
    assert_fenced_everywhere(queue, stale)
    queue.finish(fresh, {"by": "w2"})
    assert_fenced_everywhere(queue, stale)
    assert_one_reply(queue, tid, "done", {"by": "w2"})


def test_same_owner_name_with_an_old_fence_is_fenced(queue: TaskQueue, clock: ManualClock) -> None:
    """The fence, not the owner name, decides: a restarted worker reusing its name is stale."""
    tid = submit(queue, clock, "m-1")
    stale = claim(queue, "w1")
    clock.advance(LEASE + 1)
    fresh = claim(queue, "w1")
    assert fresh.fence == stale.fence + 1
    assert_fenced_everywhere(queue, stale)
    queue.finish(fresh, 2)
    assert_one_reply(queue, tid, "done", 2)


# --- retries and backoff ---------------------------------------------------------


@pytest.mark.parametrize("pick", ["low", "high"])
def test_retryable_fail_backs_off_exponentially(
    make_queue: MakeQueue, clock: ManualClock, pick: str
) -> None:
    rng = EdgeRng(pick)
    q = make_queue(rng=rng, backoff=2, backoff_cap=300)
    tid = submit(q, clock, "m-1", max_attempts=4)
    for attempt, ceiling in [(1, 2.0), (2, 4.0), (3, 8.0)]:
        held = claim(q)
        assert (held.attempt, held.fence) == (attempt, attempt)
        failed_at = clock()
        assert q.fail(held, f"boom {attempt}") == "pending"
        row = task(q, tid)
        delay = ceiling / 2 if pick == "low" else ceiling
        assert (row["state"], row["available_at"], row["last_error"], row["lease_until"]) == (
            "pending",
            failed_at + delay,
            f"boom {attempt}",
            None,
        )
        assert row["finished_at"] is None
        assert q.claim("w") is None  # never immediately
        clock.advance(delay)
    assert rng.calls == [(1.0, 2.0), (2.0, 4.0), (4.0, 8.0)]
    assert q.messages() == []


def test_backoff_is_capped(make_queue: MakeQueue, clock: ManualClock) -> None:
    q = make_queue(rng=EdgeRng("high"), backoff=2, backoff_cap=5)
    tid = submit(q, clock, "m-1", max_attempts=6)
    delays = []
    for _ in range(5):
        failed_at = clock()
        assert q.fail(claim(q), "again") == "pending"
        delay = task(q, tid)["available_at"] - failed_at
        delays.append(delay)
        clock.advance(delay)
    assert delays == [2, 4, 5, 5, 5]


def test_backoff_with_real_randomness_stays_in_its_window(
    queue: TaskQueue, clock: ManualClock
) -> None:
    assert (queue.backoff, queue.backoff_cap) == (2, 300)
    ids = [submit(queue, clock, f"m-{i}", max_attempts=4) for i in range(3)]
    for attempt in (1, 2, 3):
        ceiling = 2.0 * 2 ** (attempt - 1)
        failed_at = clock()
        for _ in ids:
            held = claim(queue)
            assert held.attempt == attempt
            queue.fail(held, "transient")
        for tid in ids:
            due = task(queue, tid)["available_at"]
            assert failed_at + ceiling / 2 <= due <= failed_at + ceiling
        clock.advance(ceiling)


def test_exhausted_retries_fail_the_task_with_one_reply(
    make_queue: MakeQueue, clock: ManualClock
) -> None:
    q = make_queue(rng=EdgeRng("high"))
    tid = submit(q, clock, "m-1", max_attempts=2)
    assert q.fail(claim(q), "first") == "pending"
    clock.advance(2)
    last = claim(q)
    assert last.attempt == 2
    assert q.fail(last, "second") == "failed"
    row = task(q, tid)
    assert (row["state"], row["attempts"], row["last_error"], row["finished_at"]) == (
        "failed",
        2,
        "second",
        clock(),
    )
    assert row["lease_until"] is None
    exhausted = ("attempts_exhausted", "second")
    assert_one_reply(q, tid, "failed", error=exhausted)
    clock.advance(1000)
    assert q.claim("w") is None
    q.reconcile()
    assert_fenced_everywhere(q, last)
    assert_one_reply(q, tid, "failed", error=exhausted)


def test_permanent_failure_fails_at_once(queue: TaskQueue, clock: ManualClock) -> None:
    tid = submit(queue, clock, "m-1", max_attempts=5)
    held = claim(queue)
    assert queue.fail(held, "bad input", permanent=True) == "failed"
    row = task(queue, tid)
    assert (row["state"], row["attempts"], row["last_error"]) == ("failed", 1, "bad input")
    assert_one_reply(queue, tid, "failed", error=("permanent_failure", "bad input"))
    clock.advance(1000)
    assert queue.claim("w") is None
    assert_one_reply(queue, tid, "failed", error=("permanent_failure", "bad input"))


@pytest.mark.parametrize("via", ["reconcile", "claim"])
def test_lease_expiry_without_attempts_left_fails_the_task(
    queue: TaskQueue, clock: ManualClock, via: str
) -> None:
    tid = submit(queue, clock, "m-1", max_attempts=2)
    first = claim(queue, "w1")
    clock.advance(LEASE + 1)
    second = claim(queue, "w2")  # attempt 2 of 2 after the first lease expired
    assert (second.fence, second.attempt) == (2, 2)
    assert_fenced_everywhere(queue, first)
    clock.advance(LEASE + 1)
    if via == "reconcile":
        assert queue.reconcile() == {
            "expired": 0,
            "requeued": 0,
            "failed": 1,
            "messages_requeued": 0,
        }
    else:
        assert queue.claim("w3") is None
    row = task(queue, tid)
    assert (row["state"], row["last_error"], row["attempts"]) == (
        "failed",
        "lease expired with no attempts left",
        2,
    )
    assert row["finished_at"] == clock()
    lease_expired = ("lease_expired", "lease expired with no attempts left")
    assert_one_reply(queue, tid, "failed", error=lease_expired)
    assert_fenced_everywhere(queue, second)
    assert queue.reconcile()["failed"] == 0
    assert_one_reply(queue, tid, "failed", error=lease_expired)


# --- deadlines ---------------------------------------------------------------------


def test_deadline_passing_while_running_expires_the_task(
    queue: TaskQueue, clock: ManualClock
) -> None:
    tid = submit(queue, clock, "m-1", deadline_in=30)
    held = claim(queue)
    for _ in range(3):
        clock.advance(8)
        held = queue.renew(held)
    assert held.lease_until > held.deadline  # the lease now runs past the deadline
    clock.advance(6)  # now == deadline, inside the lease
    before = task(queue, tid)
    with pytest.raises(Fenced):
        queue.renew(held)
    with pytest.raises(Fenced):
        queue.finish(held, "too late")
    with pytest.raises(Fenced):
        queue.fail(held, "too late")
    assert task(queue, tid) == before
    assert queue.messages() == []
    assert queue.reconcile() == {"expired": 1, "requeued": 0, "failed": 0, "messages_requeued": 0}
    row = task(queue, tid)
    assert (row["state"], row["last_error"], row["result"]) == ("expired", "deadline passed", None)
    assert_one_reply(queue, tid, "expired", error=DEADLINE_PASSED)
    assert_fenced_everywhere(queue, held)
    assert queue.reconcile()["expired"] == 0
    assert_one_reply(queue, tid, "expired", error=DEADLINE_PASSED)


@pytest.mark.parametrize("via", ["reconcile", "claim"])
def test_pending_task_past_its_deadline_expires(
    queue: TaskQueue, clock: ManualClock, via: str
) -> None:
    tid = submit(queue, clock, "m-1", deadline_in=30)
    clock.advance(31)
    if via == "reconcile":
        assert queue.reconcile()["expired"] == 1
    else:
        assert queue.claim("w") is None
    assert task(queue, tid)["state"] == "expired"
    assert_one_reply(queue, tid, "expired", error=DEADLINE_PASSED)


def test_retry_scheduled_after_the_deadline_expires(
    make_queue: MakeQueue, clock: ManualClock
) -> None:
    q = make_queue(rng=EdgeRng("high"), backoff=20, backoff_cap=20)
    tid = submit(q, clock, "m-1", deadline_in=15)
    q.fail(claim(q), "transient")  # due again at +20, after the deadline at +15
    clock.advance(20)
    assert q.claim("w") is None
    assert task(q, tid)["state"] == "expired"
    assert_one_reply(q, tid, "expired", error=DEADLINE_PASSED)


# --- cancel ---------------------------------------------------------------------------


def test_cancel_pending_task(queue: TaskQueue, clock: ManualClock) -> None:
    tid = submit(queue, clock, "m-1")
    assert queue.cancel(tid) is True
    row = task(queue, tid)
    assert (row["state"], row["cancel_requested_at"], row["finished_at"]) == (
        "cancelled",
        clock(),
        clock(),
    )
    assert_one_reply(queue, tid, "cancelled", error=CANCELLED)
    assert queue.claim("w") is None
    assert queue.cancel(tid) is False
    assert_one_reply(queue, tid, "cancelled", error=CANCELLED)


def test_cancel_task_waiting_for_its_retry(make_queue: MakeQueue, clock: ManualClock) -> None:
    q = make_queue(rng=EdgeRng("high"))
    tid = submit(q, clock, "m-1")
    q.fail(claim(q), "transient")
    assert q.cancel(tid) is True
    clock.advance(100)
    assert q.claim("w") is None
    assert task(q, tid)["state"] == "cancelled"
    assert_one_reply(q, tid, "cancelled", error=CANCELLED)


def test_cancel_running_task_fences_its_worker(queue: TaskQueue, clock: ManualClock) -> None:
    tid = submit(queue, clock, "m-1")
    held = claim(queue)
    assert queue.cancel(tid) is True
    assert task(queue, tid)["state"] == "cancelled"
    assert_one_reply(queue, tid, "cancelled", error=CANCELLED)
    assert_fenced_everywhere(queue, held)
    clock.advance(LEASE + 1)
    assert queue.reconcile() == {"expired": 0, "requeued": 0, "failed": 0, "messages_requeued": 0}
    assert queue.claim("w2") is None
    assert task(queue, tid)["state"] == "cancelled"
    assert_one_reply(queue, tid, "cancelled", error=CANCELLED)


def test_cancel_reason_is_stored_and_carried_by_the_reply(
    queue: TaskQueue, clock: ManualClock
) -> None:
    tid = submit(queue, clock, "m-1")
    assert queue.cancel(tid, reason="order withdrawn by the customer") is True
    assert task(queue, tid)["last_error"] == "order withdrawn by the customer"
    assert_one_reply(
        queue, tid, "cancelled", error=("cancelled", "order withdrawn by the customer")
    )


def test_reply_reason_is_cut_to_the_stored_limit(queue: TaskQueue, clock: ManualClock) -> None:
    tid = submit(queue, clock, "m-1")
    long_reason = "\x00" + "é" * (MAX_REASON_CHARS * 3)
    assert queue.fail(claim(queue), long_reason, permanent=True) == "failed"
    stored = task(queue, tid)["last_error"]
    assert stored == ("\\x00" + "é" * MAX_REASON_CHARS)[:MAX_REASON_CHARS]
    assert_one_reply(queue, tid, "failed", error=("permanent_failure", stored))


def finish_one(queue: TaskQueue, clock: ManualClock) -> str:
    tid = submit(queue, clock, "done")
    queue.finish(claim(queue), {"answer": 42})
    return tid


def fail_one(queue: TaskQueue, clock: ManualClock) -> str:
    tid = submit(queue, clock, "failed")
    queue.fail(claim(queue), "bad", permanent=True)
    return tid


def expire_one(queue: TaskQueue, clock: ManualClock) -> str:
    return submit(queue, clock, "expired", deadline_in=-1)


def hop_limit_one(queue: TaskQueue, clock: ManualClock) -> str:
    return submit(queue, clock, "hops", hops=9)


def cancel_one(queue: TaskQueue, clock: ManualClock) -> str:
    tid = submit(queue, clock, "cancelled")
    assert queue.cancel(tid)
    return tid


@pytest.mark.parametrize(
    "make_terminal",
    [finish_one, fail_one, expire_one, hop_limit_one, cancel_one],
    ids=["done", "failed", "expired", "hop_limit", "cancelled"],
)
def test_cancel_of_a_terminal_task_returns_false_and_changes_nothing(
    queue: TaskQueue, clock: ManualClock, make_terminal: Callable[[TaskQueue, ManualClock], str]
) -> None:
    tid = make_terminal(queue, clock)
    before_task, before_replies = task(queue, tid), queue.messages()
    assert len(before_replies) == 1
    clock.advance(1)
    assert queue.cancel(tid) is False
    assert task(queue, tid) == before_task
    assert queue.messages() == before_replies


def test_cancel_of_an_unknown_task_returns_false(queue: TaskQueue) -> None:
    assert queue.cancel("0" * 64) is False
    assert queue.messages() == []


# --- per-tenant cap ---------------------------------------------------------------------


def test_tenant_cap_skips_tenants_at_their_cap(make_queue: MakeQueue, clock: ManualClock) -> None:
    q = make_queue(tenant_cap=1)
    a1 = submit(q, clock, "a1", auth=A)
    clock.advance(1)
    a2 = submit(q, clock, "a2", auth=A)
    clock.advance(1)
    b1 = submit(q, clock, "b1", auth=B)
    first = claim(q, "w1")
    assert first.task_id == a1
    second = claim(q, "w2")
    assert second.task_id == b1  # agent-a is at its cap of 1, though a2 is older
    assert q.claim("w3") is None
    q.finish(first, "a1 done")
    third = claim(q, "w3")
    assert third.task_id == a2
    assert q.claim("w4") is None


@pytest.mark.parametrize("release", ["fail", "lease-expiry", "cancel"])
def test_tenant_slot_is_released_when_the_running_task_leaves_running(
    make_queue: MakeQueue, clock: ManualClock, release: str
) -> None:
    q = make_queue(tenant_cap=1, rng=EdgeRng("high"))
    a1 = submit(q, clock, "a1", max_attempts=5)
    clock.advance(1)
    a2 = submit(q, clock, "a2")
    held = claim(q)
    assert held.task_id == a1
    assert q.claim("w") is None
    if release == "fail":
        q.fail(held, "transient")  # a1 is due again 2 s later; a2 is due now
    elif release == "lease-expiry":
        clock.advance(LEASE + 1)  # both due: a1 (available now) comes after a2 (older due)
    else:
        q.cancel(a1)
    assert claim(q).task_id == a2


def test_tenant_cap_uses_the_tenant_id_not_the_principal(
    make_queue: MakeQueue, clock: ManualClock
) -> None:
    q = make_queue(tenant_cap=1)
    shared_a = AuthContext("agent-a", tenant_id="acme")
    shared_b = AuthContext("agent-b", tenant_id="acme")
    x = submit(q, clock, "x", auth=shared_a)
    clock.advance(1)
    submit(q, clock, "y", auth=shared_b)
    assert task(q, x)["tenant_id"] == "acme"
    assert claim(q).task_id == x
    assert q.claim("w") is None


def test_tenant_cap_of_two(make_queue: MakeQueue, clock: ManualClock) -> None:
    q = make_queue(tenant_cap=2)
    ids_a = []
    for i in range(3):
        ids_a.append(submit(q, clock, f"a{i}", auth=A))
        clock.advance(1)
    b0 = submit(q, clock, "b0", auth=B)
    got = [c.task_id for c in q.claim_many("w", 10)]
    assert got == [ids_a[0], ids_a[1], b0]
    assert q.claim("w") is None


def test_claim_many_respects_the_tenant_cap(make_queue: MakeQueue, clock: ManualClock) -> None:
    q = make_queue(tenant_cap=1)
    a1 = submit(q, clock, "a1", auth=A)
    clock.advance(1)
    submit(q, clock, "a2", auth=A)
    clock.advance(1)
    b1 = submit(q, clock, "b1", auth=B)
    assert [c.task_id for c in q.claim_many("w", 10)] == [a1, b1]


# --- claim_many -------------------------------------------------------------------------


def test_claim_many_returns_several_in_claim_order(queue: TaskQueue, clock: ManualClock) -> None:
    ids = {}
    for name, priority in [("p0", 0), ("p3", 3), ("p1", 1), ("p3b", 3), ("p-1", -1)]:
        ids[name] = submit(queue, clock, name, priority=priority)
        clock.advance(1)
    batch = queue.claim_many("w", 3)
    assert [c.task_id for c in batch] == [ids["p3"], ids["p3b"], ids["p1"]]
    assert all((c.fence, c.attempt, c.owner) == (1, 1, "w") for c in batch)
    assert all(c.lease_until == clock() + LEASE for c in batch)
    rest = queue.claim_many("w2", 10)
    assert [c.task_id for c in rest] == [ids["p0"], ids["p-1"]]
    assert queue.claim_many("w3", 10) == []
    for held in batch + rest:
        assert task(queue, held.task_id)["state"] == "running"


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_claim_many_rejects_a_bad_limit(queue: TaskQueue, clock: ManualClock, limit: Any) -> None:
    tid = submit(queue, clock, "m-1")
    with pytest.raises(ValueError, match="limit"):
        queue.claim_many("w", limit)
    assert task(queue, tid)["state"] == "pending"


@pytest.mark.parametrize("owner", ["", "x" * 201, None])
def test_claim_rejects_a_bad_owner(queue: TaskQueue, clock: ManualClock, owner: Any) -> None:
    tid = submit(queue, clock, "m-1")
    with pytest.raises(ValueError, match="owner"):
        queue.claim(owner)
    assert task(queue, tid)["state"] == "pending"


# --- finish -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "result",
    [None, 0, -1.5, "text ü€", [1, "two", None], {"nested": {"list": [True, False]}}],
    ids=["none", "zero", "float", "text", "list", "dict"],
)
def test_finish_stores_the_result_and_its_reply(
    queue: TaskQueue, clock: ManualClock, result: Any
) -> None:
    tid = submit(queue, clock, "m-1")
    held = claim(queue)
    clock.advance(3)
    queue.finish(held, result)
    row = task(queue, tid)
    assert (row["state"], row["result"], row["finished_at"], row["lease_until"]) == (
        "done",
        result,
        clock(),
        None,
    )
    assert_one_reply(queue, tid, "done", result)
    assert_fenced_everywhere(queue, held)


@pytest.mark.parametrize(
    "result",
    [
        pytest.param({"x": float("nan")}, id="nan"),
        pytest.param(float("inf"), id="inf"),
        pytest.param({1, 2}, id="set"),
        pytest.param(b"bytes", id="bytes"),
        pytest.param((1, 2), id="tuple"),
        pytest.param({1: "int key"}, id="int-key"),
        pytest.param(object(), id="object"),
        pytest.param("\ud800", id="lone-surrogate"),
        pytest.param("x" * (256 * 1024 + 1), id="too-large"),
    ],
)
def test_finish_with_a_result_that_is_not_json_safe_keeps_the_task_running(
    queue: TaskQueue, clock: ManualClock, result: Any
) -> None:
    tid = submit(queue, clock, "m-1")
    held = claim(queue)
    before = task(queue, tid)
    with pytest.raises(InvalidMessage) as raised:
        queue.finish(held, result)
    assert isinstance(raised.value, ValueError)
    assert task(queue, tid) == before
    assert queue.messages() == []
    queue.finish(held, {"fixed": True})
    assert_one_reply(queue, tid, "done", {"fixed": True})


def test_a_claim_without_reconcile_leaves_expired_leases_to_one_that_reconciles(
    queue: TaskQueue, clock: ManualClock
) -> None:
    tid = submit(queue, clock, "m-1")
    first = claim(queue, "w1")
    clock.advance(LEASE + 1)
    assert queue.claim_many("w2", 1, reconcile=False) == []
    assert task(queue, tid)["owner"] == "w1"
    [retaken] = queue.claim_many("w2", 1)
    assert (retaken.task_id, retaken.owner, retaken.fence) == (tid, "w2", first.fence + 1)


def test_finish_many_commits_each_held_claim_and_refuses_the_others_alone(
    queue: TaskQueue, clock: ManualClock
) -> None:
    submit(queue, clock, "m-stale")
    stale = claim(queue, "w")
    clock.advance(LEASE + 1)
    retaken = claim(queue, "w2")  # `stale` lost its lease to w2 under a higher fence
    assert retaken.task_id == stale.task_id
    ids = [submit(queue, clock, f"m-{n}") for n in range(3)]
    held = {c.task_id: c for c in queue.claim_many("w", 3)}
    good, unstorable, cancelled = (held[tid] for tid in ids)
    assert queue.cancel(cancelled.task_id)
    refused = queue.finish_many(
        [(good, {"ok": 1}), (stale, {"ok": 2}), (unstorable, {"x": float("nan")}), (cancelled, 3)]
    )
    assert refused[0] is None
    assert isinstance(refused[1], Fenced)
    assert "held by 'w2'" in str(refused[1])
    assert isinstance(refused[2], InvalidMessage)
    assert isinstance(refused[3], Fenced)
    assert "cancelled" in str(refused[3])
    assert_one_reply(queue, good.task_id, "done", {"ok": 1})
    assert replies_for(queue, stale.task_id) == []
    assert task(queue, stale.task_id)["state"] == "running"
    assert task(queue, unstorable.task_id)["state"] == "running"
    assert_one_reply(queue, cancelled.task_id, "cancelled", error=CANCELLED)


@pytest.mark.parametrize("stale_first", [True, False], ids=["stale-first", "fresh-first"])
def test_finish_many_with_two_claims_of_one_task_commits_only_the_newer(
    queue: TaskQueue, clock: ManualClock, stale_first: bool
) -> None:
    tid = submit(queue, clock, "m-1")
    stale = claim(queue, "w")
    clock.advance(LEASE + 1)
    fresh = claim(queue, "w")  # the same worker took its lost task again
    assert fresh.fence == stale.fence + 1
    pairs = [(stale, {"from": "stale"}), (fresh, {"from": "fresh"})]
    refused = queue.finish_many(pairs if stale_first else pairs[::-1])
    by_fence = dict(
        zip([c.fence for c, _ in (pairs if stale_first else pairs[::-1])], refused, strict=True)
    )
    assert by_fence[fresh.fence] is None
    assert isinstance(by_fence[stale.fence], Fenced)
    assert_one_reply(queue, tid, "done", {"from": "fresh"})


def test_finish_many_reports_a_refusal_even_when_its_reason_cannot_be_read(
    queue: TaskQueue, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid = submit(queue, clock, "m-1")
    stale = claim(queue, "w")
    clock.advance(LEASE + 1)
    claim(queue, "w2")
    good_id = submit(queue, clock, "m-2")
    good = claim(queue, "w")

    def unreadable(conn: Any, held: Claim) -> Fenced:
        raise sa.exc.OperationalError("SELECT", {}, Exception("connection lost"))

    monkeypatch.setattr(task_results, "fenced", unreadable)
    refused = queue.finish_many([(stale, "late"), (good, "ok")])
    assert isinstance(refused[0], Fenced)
    assert "could not be read" in str(refused[0])
    assert refused[1] is None
    assert_one_reply(queue, good_id, "done", "ok")
    assert replies_for(queue, tid) == []


def test_finish_many_of_nothing_writes_nothing(queue: TaskQueue) -> None:
    assert queue.finish_many([]) == []
    assert queue.messages() == []


@pytest.fixture
def effects(queue: TaskQueue) -> Iterator[sa.Table]:
    """A business table of the test's own, in the same database as the outbox."""
    metadata = sa.MetaData()
    table = sa.Table(
        "core_test_effects",
        metadata,
        sa.Column("task_id", sa.String(64), primary_key=True),
        sa.Column("note", sa.Text(), nullable=False),
    )
    metadata.create_all(queue.engine)
    yield table
    metadata.drop_all(queue.engine)


def effect_rows(queue: TaskQueue, effects: sa.Table) -> list[tuple[Any, ...]]:
    with queue.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(effects).order_by(effects.c.task_id))]


def test_finish_effect_commits_with_the_result(
    queue: TaskQueue, clock: ManualClock, effects: sa.Table
) -> None:
    tid = submit(queue, clock, "m-1")
    held = claim(queue)
    seen_state: list[str] = []

    def effect(session: Session) -> None:
        session.execute(sa.insert(effects).values(task_id=held.task_id, note="charged"))
        state = session.execute(
            sa.text("SELECT state FROM outbox_tasks WHERE task_id = :t"), {"t": held.task_id}
        ).scalar_one()
        seen_state.append(state)

    queue.finish(held, {"charged": True}, effect=effect)
    assert seen_state == ["done"]  # the effect runs inside the finishing transaction
    assert effect_rows(queue, effects) == [(tid, "charged")]
    assert task(queue, tid)["state"] == "done"
    assert_one_reply(queue, tid, "done", {"charged": True})


def test_failing_effect_rolls_back_the_result_too(
    queue: TaskQueue, clock: ManualClock, effects: sa.Table
) -> None:
    tid = submit(queue, clock, "m-1")
    held = claim(queue)
    before = task(queue, tid)

    def effect(session: Session) -> None:
        session.execute(sa.insert(effects).values(task_id=held.task_id, note="half"))
        raise RuntimeError("business write failed")

    with pytest.raises(RuntimeError, match="business write failed"):
        queue.finish(held, "result", effect=effect)
    assert task(queue, tid) == before
    assert queue.messages() == []
    assert effect_rows(queue, effects) == []
    queue.finish(held, "result")  # the lease still holds: the worker can try again
    assert_one_reply(queue, tid, "done", "result")


def test_stale_finish_commits_no_effect(
    queue: TaskQueue, clock: ManualClock, effects: sa.Table
) -> None:
    tid = submit(queue, clock, "m-1")
    stale = claim(queue, "w1")
    clock.advance(LEASE + 1)
    fresh = claim(queue, "w2")

    def effect(session: Session) -> None:
        session.execute(sa.insert(effects).values(task_id=stale.task_id, note="stale"))

    with pytest.raises(Fenced):
        queue.finish(stale, "stale", effect=effect)
    assert effect_rows(queue, effects) == []
    assert queue.messages() == []
    queue.finish(fresh, "fresh")
    assert_one_reply(queue, tid, "done", "fresh")


def test_finish_tx_joins_the_callers_transaction(
    queue: TaskQueue, clock: ManualClock, effects: sa.Table
) -> None:
    tid = submit(queue, clock, "m-1")
    held = claim(queue)
    with Session(queue.engine) as session:
        queue.finish_tx(session, held, "in tx")
        session.execute(sa.insert(effects).values(task_id=tid, note="mine"))
        assert task(queue, tid)["state"] == "running"  # not visible before commit
        assert queue.messages() == []
        session.rollback()
    assert task(queue, tid)["state"] == "running"
    assert queue.messages() == []
    assert effect_rows(queue, effects) == []
    with Session(queue.engine) as session:
        queue.finish_tx(session, held, "in tx")
        session.execute(sa.insert(effects).values(task_id=tid, note="mine"))
        session.commit()
    assert task(queue, tid)["state"] == "done"
    assert effect_rows(queue, effects) == [(tid, "mine")]
    assert_one_reply(queue, tid, "done", "in tx")


# --- reconcile and delivery leases ---------------------------------------------------------


def test_reconcile_reclaims_expired_delivery_leases(queue: TaskQueue, clock: ManualClock) -> None:
    tid = submit(queue, clock, "m-1")
    queue.finish(claim(queue), "r")
    with queue.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_messages SET state = 'sending', owner = 'relay-1', "
                "lease_until = :until, fence = 1, attempts = 1"
            ),
            {"until": clock() + 30},
        )
    clock.advance(29)
    assert queue.reconcile()["messages_requeued"] == 0
    assert [r["state"] for r in queue.messages()] == ["sending"]
    clock.advance(1)
    assert queue.reconcile()["messages_requeued"] == 1
    [reply] = queue.messages()
    assert (reply["state"], reply["lease_until"], reply["fence"]) == ("pending", None, 1)
    assert reply["available_at"] <= clock()
    assert_one_reply(queue, tid, "done", "r")


def test_reconcile_handles_more_than_one_batch(queue: TaskQueue, clock: ManualClock) -> None:
    count = RECONCILE_BATCH + 5
    envelopes = [Envelope(f"m-{i}", "agent-a", {"i": i}, clock() + 10) for i in range(count)]
    queue.receive_batch(A, envelopes)
    clock.advance(10)
    assert queue.reconcile()["expired"] == count
    replies = queue.messages("pending")
    assert len(replies) == count
    assert {json.loads(r["body"])["status"] for r in replies} == {"expired"}


# --- the database clock ---------------------------------------------------------------------


def test_without_a_manual_clock_the_database_clock_governs(db_url: str) -> None:
    with TaskQueue(db_url, allowed_sources=("agent-a",)) as q:
        wall = time.time()
        live = q.receive(A, Envelope("live", "agent-a", {"n": 1}, wall + 3600)).task_id
        late = q.receive(A, Envelope("late", "agent-a", {"n": 2}, wall - 60)).task_id
        assert task(q, late)["state"] == "expired"
        held = claim(q)
        assert held.task_id == live
        assert abs(held.lease_until - (time.time() + q.lease)) < 60
        q.finish(held, "ok")
        assert task(q, live)["state"] == "done"
        assert_one_reply(q, live, "done", "ok")
        assert_one_reply(
            q, late, "expired", error=("deadline_passed", "deadline passed before intake")
        )


def test_manual_clock_only_moves_forward() -> None:
    clock = ManualClock(5.0)
    assert clock() == 5.0
    assert clock.advance(2.5) == 7.5
    with pytest.raises(ValueError, match="back"):
        clock.advance(-1)
    assert clock() == 7.5


def test_release_gives_a_claimed_task_back_unrun_and_only_under_its_claim(
    queue: TaskQueue, clock: ManualClock
) -> None:
    task_id = submit(queue, clock, "m-release")
    held = claim(queue, "w-1")
    assert queue.release(held)
    released = task(queue, task_id)
    assert (released["state"], released["attempts"], released["lease_until"]) == (
        "pending",
        0,
        None,
    )
    assert not queue.release(held)  # no longer held: nothing changes
    again = claim(queue, "w-2")
    assert (again.task_id, again.attempt, again.fence) == (task_id, 1, held.fence + 1)


def nested(lists: int) -> Any:
    """A number inside `lists` nested lists."""
    value: Any = 1
    for _ in range(lists):
        value = [value]
    return value


@pytest.mark.parametrize(
    "result",
    [
        None,
        {"z": 1, "a": [True, None, -0.0, 1e308, 2**70], "m": {"y": "é", "b": "\u2028\x01"}},
        'a string with "quotes", \\ and \U0001f600',
        nested(MAX_DEPTH),  # as deep as a result may be: the reply adds a level of its own
        list(range(MAX_NODES - 1)),  # as many nodes as a result may have, with its list
    ],
    ids=["null", "unsorted-keys", "string", "deepest", "most-nodes"],
)
def test_a_result_within_its_limits_is_committed_with_the_canonical_reply(
    queue: TaskQueue, clock: ManualClock, result: Any
) -> None:
    task_id = submit(queue, clock, "m1")
    held = claim(queue)
    assert queue.finish_many([(held, result)]) == [None]
    assert task(queue, task_id)["state"] == "done"
    assert_one_reply(queue, task_id, "done", result=result)
