"""Group commit: results finished together share one transaction, each with its own outcome."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from outbox import AuthContext, Claim, Envelope, Fenced, TaskQueue
from outbox.errors import OutboxError
from outbox.result_group_commit import ResultGroupCommit
from outbox.testing import ManualClock

A = AuthContext("agent-a")
WAIT = 10.0  # seconds: a deadline for what should take milliseconds


class GatedQueue:
    """Wraps finish_many: records each batch, and holds the first until told to go on."""

    def __init__(self, queue: TaskQueue, fail_with: BaseException | None = None) -> None:
        self.queue = queue
        self.batches: list[list[str]] = []
        self.first_entered = threading.Event()
        self.release_first = threading.Event()
        self.fail_with = fail_with

    def finish_many(self, finished: Sequence[tuple[Claim, Any]]) -> list[OutboxError | None]:
        self.batches.append([claim.task_id for claim, _ in finished])
        if len(self.batches) == 1:
            self.first_entered.set()
            assert self.release_first.wait(WAIT)
        elif self.fail_with is not None:
            raise self.fail_with
        return self.queue.finish_many(finished)


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        threading.Event().wait(0.005)


def claims(queue: TaskQueue, clock: ManualClock, count: int) -> list[Claim]:
    for n in range(count):
        queue.receive(A, Envelope(f"m-{n}", "agent-a", {"n": n}, clock() + 3600))
    held = queue.claim_many("w", count)
    assert len(held) == count
    return held


def run_finishes(
    group: ResultGroupCommit, gate: GatedQueue, work: list[tuple[Claim, Any]]
) -> dict[str, BaseException | None]:
    """Finish the first alone; the rest arrive while it writes and must share one batch."""
    outcomes: dict[str, BaseException | None] = {}

    def finish(claim: Claim, result: Any) -> None:
        try:
            group.finish(claim, result)
            outcomes[claim.task_id] = None
        except BaseException as exc:
            outcomes[claim.task_id] = exc

    threads = [threading.Thread(target=finish, args=pair) for pair in work]
    threads[0].start()
    assert gate.first_entered.wait(WAIT)
    for thread in threads[1:]:
        thread.start()
    until(lambda: len(group._waiting) == len(work) - 1)
    gate.release_first.set()
    for thread in threads:
        thread.join(WAIT)
        assert not thread.is_alive()
    return outcomes


def test_results_that_arrive_while_one_is_written_share_the_next_transaction(
    queue: TaskQueue, clock: ManualClock
) -> None:
    held = claims(queue, clock, 5)
    gate = GatedQueue(queue)
    group = ResultGroupCommit(gate)  # type: ignore[arg-type]
    outcomes = run_finishes(group, gate, [(c, {"n": i}) for i, c in enumerate(held)])
    assert outcomes == {c.task_id: None for c in held}
    assert len(gate.batches) == 2
    assert gate.batches[0] == [held[0].task_id]
    assert sorted(gate.batches[1]) == sorted(c.task_id for c in held[1:])
    for i, claim in enumerate(held):
        row = queue.task(claim.task_id)
        assert row is not None
        assert (row["state"], row["result"]) == ("done", {"n": i})
    assert len(queue.messages()) == 5


def test_a_fenced_result_is_refused_to_its_own_caller_only(
    queue: TaskQueue, clock: ManualClock
) -> None:
    held = claims(queue, clock, 3)
    assert queue.cancel(held[2].task_id)
    gate = GatedQueue(queue)
    outcomes = run_finishes(ResultGroupCommit(gate), gate, [(c, "r") for c in held])  # type: ignore[arg-type]
    assert outcomes[held[0].task_id] is None
    assert outcomes[held[1].task_id] is None
    assert isinstance(outcomes[held[2].task_id], Fenced)
    assert [r["task_id"] for r in queue.messages() if r["task_id"] == held[2].task_id] == [
        held[2].task_id
    ]  # only the cancellation's reply


def test_a_database_error_reaches_every_caller_of_that_batch_and_commits_none(
    queue: TaskQueue, clock: ManualClock
) -> None:
    held = claims(queue, clock, 4)
    error = sa.exc.OperationalError("COMMIT", {}, Exception("connection lost"))
    gate = GatedQueue(queue, fail_with=error)
    outcomes = run_finishes(ResultGroupCommit(gate), gate, [(c, "r") for c in held])  # type: ignore[arg-type]
    assert outcomes[held[0].task_id] is None
    for claim in held[1:]:
        assert outcomes[claim.task_id] is error
        row = queue.task(claim.task_id)
        assert row is not None
        assert row["state"] == "running"


def test_alone_a_result_is_written_at_once(queue: TaskQueue, clock: ManualClock) -> None:
    held = claims(queue, clock, 3)
    group = ResultGroupCommit(queue)
    for claim in held:
        group.finish(claim, "r")
        row = queue.task(claim.task_id)
        assert row is not None
        assert row["state"] == "done"
