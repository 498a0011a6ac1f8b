"""Group commit: results finished together share one transaction, each with its own outcome."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import AuthContext, Claim, Envelope, Fenced, TaskQueue
from outbox.errors import OutboxError
from outbox.group_commit import GroupCommit
from outbox.testing import ManualClock

A = AuthContext("agent-a")
WAIT = 10.0  # seconds: a deadline for what should take milliseconds
Finished = tuple[Claim, Any]


class GatedQueue:
    """Wraps finish_many: records each batch, and holds the first until told to go on."""

    def __init__(self, queue: TaskQueue, fail_with: BaseException | None = None) -> None:
        self.queue = queue
        self.batches: list[list[str]] = []
        self.first_entered = threading.Event()
        self.release_first = threading.Event()
        self.fail_with = fail_with

    def finish_many(self, finished: Sequence[Finished]) -> list[OutboxError | None]:
        self.batches.append([claim.task_id for claim, _ in finished])
        if len(self.batches) == 1:
            self.first_entered.set()
            assert self.release_first.wait(WAIT)
        elif self.fail_with is not None:
            raise self.fail_with
        return self.queue.finish_many(finished)


def group_on(gate: GatedQueue | TaskQueue) -> GroupCommit[Finished, OutboxError | None]:
    """A group commit that writes results through `gate` on a thread."""

    async def write(finished: list[Finished]) -> list[OutboxError | None]:
        return await asyncio.to_thread(gate.finish_many, finished)

    return GroupCommit(write)


def claims(queue: TaskQueue, clock: ManualClock, count: int) -> list[Claim]:
    for n in range(count):
        queue.receive(A, Envelope(f"m-{n}", "agent-a", {"n": n}, clock() + 3600))
    held = queue.claim_many("w", count)
    assert len(held) == count
    return held


def run_finishes(gate: GatedQueue, work: list[Finished]) -> dict[str, BaseException | None]:
    """Finish the first alone; the rest arrive while it writes and must share one batch."""
    group = group_on(gate)
    outcomes: dict[str, BaseException | None] = {}

    async def finish(pair: Finished) -> None:
        try:
            outcomes[pair[0].task_id] = await group.submit(pair)
        except BaseException as exc:
            outcomes[pair[0].task_id] = exc

    async def scenario() -> None:
        first = asyncio.ensure_future(finish(work[0]))
        assert await asyncio.to_thread(gate.first_entered.wait, WAIT)
        rest = [asyncio.ensure_future(finish(pair)) for pair in work[1:]]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while group.waiting < len(work) - 1:
            assert loop.time() < deadline, "the later results never queued"
            await asyncio.sleep(0.005)
        gate.release_first.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), WAIT)

    asyncio.run(scenario())
    return outcomes


def test_results_that_arrive_while_one_is_written_share_the_next_transaction(
    queue: TaskQueue, clock: ManualClock
) -> None:
    held = claims(queue, clock, 5)
    gate = GatedQueue(queue)
    outcomes = run_finishes(gate, [(c, {"n": i}) for i, c in enumerate(held)])
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
    outcomes = run_finishes(GatedQueue(queue), [(c, "r") for c in held])
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
    outcomes = run_finishes(GatedQueue(queue, fail_with=error), [(c, "r") for c in held])
    assert outcomes[held[0].task_id] is None
    for claim in held[1:]:
        assert outcomes[claim.task_id] is error
        row = queue.task(claim.task_id)
        assert row is not None
        assert row["state"] == "running"


def test_alone_a_result_is_written_at_once(queue: TaskQueue, clock: ManualClock) -> None:
    held = claims(queue, clock, 3)
    group = group_on(queue)

    async def one_by_one() -> None:
        for claim in held:
            assert await group.submit((claim, "r")) is None
            row = queue.task(claim.task_id)
            assert row is not None
            assert row["state"] == "done"

    asyncio.run(one_by_one())


def test_a_batch_takes_at_most_max_batch_items() -> None:
    batches: list[list[int]] = []

    async def write(items: list[int]) -> list[int]:
        batches.append(items)
        await asyncio.sleep(0)
        return [item * 2 for item in items]

    async def scenario() -> list[int]:
        group: GroupCommit[int, int] = GroupCommit(write, max_batch=3)
        return await asyncio.gather(*(group.submit(n) for n in range(8)))

    assert asyncio.run(scenario()) == [n * 2 for n in range(8)]
    assert [len(batch) for batch in batches] == [3, 3, 2]
    assert sorted(n for batch in batches for n in batch) == list(range(8))


def test_a_write_answering_the_wrong_count_fails_its_batch() -> None:
    async def write(items: list[int]) -> list[int]:
        return []

    async def scenario() -> None:
        group: GroupCommit[int, int] = GroupCommit(write)
        with pytest.raises(RuntimeError, match="0 answers for 1 items"):
            await group.submit(1)

    asyncio.run(scenario())


def test_the_writer_carries_no_submitters_context() -> None:
    # Its current span would otherwise parent every other submitter's writes.
    submitter: contextvars.ContextVar[str] = contextvars.ContextVar("submitter", default="none")
    seen: list[str] = []

    async def write(items: list[str]) -> list[str]:
        seen.append(submitter.get())
        return items

    async def submit(commit: GroupCommit[str, str], name: str) -> str:
        submitter.set(name)
        return await commit.submit(name)

    async def both() -> list[str]:
        commit: GroupCommit[str, str] = GroupCommit(write)
        return list(await asyncio.gather(submit(commit, "first"), submit(commit, "second")))

    assert asyncio.run(both()) == ["first", "second"]
    assert seen
    assert set(seen) == {"none"}
