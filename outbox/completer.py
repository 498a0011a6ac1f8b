"""Where a finished task is written: the worker's Completer.

The executor hands every outcome here: a result, a failure, or a claim given back
unrun. This module writes it, and nothing else in the worker writes a task's end.

- A result joins a group commit (outbox.group_commit): results that finish
  together share one transaction, each still checked against its own lease and
  fence and written with its reply. The batch goes through `finishes`: the
  driver's held connection of the loop where it has one (PostgreSQL through
  psycopg: HeldFinishes), else TaskQueue's statements on a writer thread
  (QueueFinishes).
- A result the batch did not commit (its lease lost, the result refused, a
  database error that failed the whole batch) is then written alone, so one bad
  completion cannot fail the others: on a writer thread, retried through
  transient errors until the lease would have run out, and read back after an
  error whose COMMIT may have happened. A result that cannot be stored fails its
  task for good (running the handler again would repeat its side effects for the
  same refusal).
- A failure is written alone the same way: back to pending after its backoff, or
  failed with its reply once no attempt remains or the handler said so.
- A claim given back (the worker stops before its handler ran) returns to pending
  at once, its attempt not counted.

A handler may finish its task itself, with its business writes (`finish_tx`):
the completer then finds it done under this very claim and writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import sqlalchemy as sa

from outbox import failpoints, task_results
from outbox.claim import Claim
from outbox.db import retry
from outbox.db.dialect import clock_value
from outbox.drivers.task_interface import HeldTaskFinishes
from outbox.errors import Fenced, InvalidMessage, PermanentFailure
from outbox.group_commit import GroupCommit
from outbox.handler_loop import HandlerLoop
from outbox.observability.worker_metrics import WorkerMetrics
from outbox.running import Running
from outbox.states import TaskState
from outbox.task_results import ReplyContexts
from outbox.tasks import TaskQueue

log = logging.getLogger("outbox.worker")


@dataclass(frozen=True)
class Completion:
    """A handler's outcome: the result it returned, or the exception it raised."""

    running: Running
    result: Any = None
    failure: Exception | None = None


class Completer(Protocol):
    """Writes what becomes of each held claim; its methods run on the worker's loop."""

    async def complete(self, completion: Completion) -> None:
        """Write the outcome (or learn that it cannot be written) and count it."""

    async def give_back(self, running: Running) -> None:
        """Return a claim whose handler never ran: pending again, the attempt not counted."""

    async def close(self) -> None:
        """Let go of what the writes hold (connections); after the drain."""


class Finishes(Protocol):
    """How a batch of results is committed, per backend."""

    async def finish(
        self, finished: Sequence[tuple[Claim, Any]], contexts: ReplyContexts | None = None
    ) -> list[bool]:
        """Commit results with their replies in one transaction; per pair, whether it was.
        Each reply's creation context is its task's in `contexts` (None: the active span's).

        A database error raises; some of the pairs may have committed (an answer lost, or
        the held connection's second statement failing after its first): each is then
        written alone, which finds what committed."""

    async def close(self) -> None:
        """Let go of the connection it holds, if any."""


class QueueFinishes:
    """Batches through TaskQueue.finish_many (SQLAlchemy Core) on a writer thread."""

    def __init__(self, queue: TaskQueue, loop: HandlerLoop) -> None:
        """Writes through `queue` on `loop`'s writer threads."""
        self.queue = queue
        self._loop = loop

    async def finish(
        self, finished: Sequence[tuple[Claim, Any]], contexts: ReplyContexts | None = None
    ) -> list[bool]:
        """Commit results with their replies; a pair not committed was refused."""
        refused = await self._loop.write(partial(self.queue.finish_many, finished, contexts))
        return [error is None for error in refused]

    async def close(self) -> None:
        """The queue's connections stay the queue's."""


class HeldFinishes:
    """Batches in one autocommit statement on the driver's held connection of the loop."""

    def __init__(self, queue: TaskQueue, held: HeldTaskFinishes) -> None:
        """Results of `queue`'s tasks, written on `held`."""
        self.queue = queue
        self._held = held

    async def finish(
        self, finished: Sequence[tuple[Claim, Any]], contexts: ReplyContexts | None = None
    ) -> list[bool]:
        """Commit results with their replies, as finish_many does; per pair, whether it was.

        A pair not committed was refused; TaskQueue.finish_many, writing it again,
        says why. A database error raises: the statement may or may not have
        committed, as a lost COMMIT answer leaves it.
        """
        refused, completions = task_results.prepare(finished)
        if contexts is None:
            contexts = task_results.active_contexts(claim for claim, _ in finished)
        replies = task_results.done_reply_rows(completions, self.queue.reply_destination, contexts)
        now = clock_value(self.queue.clock)
        done = await self._held.complete_tasks(completions, replies, now, "finish.before_commit")
        failpoints.hit("finish.after_commit")
        return [
            error is None and claim.task_id in done
            for error, (claim, _) in zip(refused, finished, strict=True)
        ]

    async def close(self) -> None:
        """Close the held connection; batches after this raise RuntimeError."""
        await self._held.close()


def batch_finishes(queue: TaskQueue, loop: HandlerLoop) -> Finishes:
    """The batch writer for a worker of `queue`: the driver's held connection where it has
    one."""
    held = queue.driver.held_task_finishes(queue.engine, queue.owns_engine)
    return QueueFinishes(queue, loop) if held is None else HeldFinishes(queue, held)


def finished_by_handler(queue: TaskQueue, claim: Claim) -> bool:
    """Whether the handler finished its task itself: `done` under this very claim.

    Only this claim's finish can write `done` with its fence: a later claim takes a
    new fence, and a reaped task is pending, not done.
    """
    try:
        task = queue.task(claim.task_id)
    except sa.exc.DBAPIError:
        return False
    return task is not None and task["state"] == TaskState.DONE and task["fence"] == claim.fence


class BatchedCompleter:
    """The Completer: results in group commits, what they leave written one by one."""

    def __init__(
        self,
        queue: TaskQueue,
        loop: HandlerLoop,
        owner: str,
        finishes: Finishes,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """Batches go through `finishes`; single writes through `queue` on `loop`'s
        writer threads."""
        self.queue = queue
        self.owner = owner
        self.metrics = metrics
        self._loop = loop
        self._finishes = finishes
        self._together: GroupCommit[Completion, bool] = GroupCommit(self._write_together)

    async def complete(self, completion: Completion) -> None:
        """Commit the outcome, with the results that finish meanwhile when it is one."""
        running, claim = completion.running, completion.running.claim
        write: Callable[[], str]
        if completion.failure is not None:
            write = partial(self._fail, claim, completion.failure, running.reply_context)
        elif await self._together.submit(completion):
            return  # committed with the results that finished meanwhile
        else:
            write = partial(self._finish_alone, claim, completion.result, running.reply_context)
        # Single writes block: on a writer thread, while the other handlers go on.
        await self._loop.write(partial(self._settle, running, write))

    async def give_back(self, running: Running) -> None:
        """Return a claim claimed ahead that will not run here: another worker takes it."""
        await self._loop.write(partial(self._give_back, running))

    async def close(self) -> None:
        """Close the batch writer's connection."""
        await self._finishes.close()

    async def _write_together(self, completions: list[Completion]) -> list[bool]:
        """Commit results in one transaction; per completion, whether it was.

        The common case only: a result not committed here (its lease lost, the result
        refused, a database error) is then written alone by complete(), which writes
        again or reads the task to learn what happened.
        """
        held = [c for c in completions if not c.running.lost]
        if not held:
            return [False] * len(completions)
        try:
            written = await self._finishes.finish(
                [(c.running.claim, c.result) for c in held],
                {
                    c.running.claim.task_id: c.running.reply_context
                    for c in held
                    if c.running.reply_context
                },
            )
        except Exception as exc:  # noqa: BLE001 - nothing known committed: each is written alone
            log.warning(
                "worker %s: %d results not committed together (%s); writing each alone",
                self.owner,
                len(held),
                exc,
            )
            return [False] * len(completions)
        committed = set()
        for completion, was_written in zip(held, written, strict=True):
            if was_written:
                completion.running.written = True
                committed.add(completion.running.key)
                self._count("done")
        return [c.running.key in committed for c in completions]

    def _finish_alone(self, claim: Claim, result: Any, context: Mapping[str, str] | None) -> str:
        (refused,) = self.queue.finish_many([(claim, result)], {claim.task_id: context or {}})
        if isinstance(refused, InvalidMessage):
            # The result cannot be stored (not JSON, too large): running the handler again
            # would repeat its side effects for the same refusal.
            self.queue.fail(
                claim, f"result refused: {refused}", permanent=True, context=context or {}
            )
            log.error("task %s: result refused (%s); failed", claim.task_id, refused)
            return "failed"
        if refused is not None:
            raise refused
        return "done"

    def _fail(self, claim: Claim, exc: Exception, context: Mapping[str, str] | None) -> str:
        reason = f"{type(exc).__name__}: {exc}"
        permanent = isinstance(exc, PermanentFailure)
        state = self.queue.fail(claim, reason, permanent=permanent, context=context or {})
        log.info("task %s attempt %d failed (%s): %s", claim.task_id, claim.attempt, state, reason)
        return "retry" if state == TaskState.PENDING else state

    def _give_back(self, running: Running) -> None:
        try:
            released = self.queue.release(running.claim)
        except sa.exc.DBAPIError as exc:
            log.warning(
                "task %s: not given back (%s); its lease will expire", running.claim.task_id, exc
            )
            self._count("unrecorded")
            return
        self._count("released" if released else "discarded")

    def _settle(self, running: Running, write: Callable[[], str]) -> None:
        """Commit the outcome alone unless the lease is gone; re-read after an error."""
        if running.lost:
            if finished_by_handler(self.queue, running.claim):
                self._count("done")
                return
            log.warning("task %s: lease lost; outcome discarded", running.claim.task_id)
            self._count("discarded")
            return
        task_id = running.claim.task_id
        try:
            # Until the lease would have run out: after that, another worker may hold the
            # task. A refused renewal or the end of the grace period sets `stop`: give up.
            outcome = retry.until(
                partial(self._write, running, write),
                seconds=self.queue.lease,
                stop=running.stop,
                # The COMMIT may have happened: read before writing again.
                done_despite=lambda exc: self._settled(running.claim),
                on_retry=lambda exc: log.warning("task %s: write failed (%s)", task_id, exc),
            )
        except Fenced as exc:
            if finished_by_handler(self.queue, running.claim):
                self._count("done")  # with finish_tx, in the handler's own transaction
                return
            log.warning("task %s: %s; outcome discarded", task_id, exc)
            if self.metrics is not None:
                self.metrics.lease_lost()
            self._count("discarded")
            return
        except sa.exc.DBAPIError:
            log.error("task %s: outcome not recorded; its lease will expire", task_id)
            self._count("unrecorded")
            return
        # None: a write whose COMMIT answer was lost, found done when the task was re-read.
        self._count("unknown" if outcome is None else outcome)

    @staticmethod
    def _write(running: Running, write: Callable[[], str]) -> str:
        outcome = write()
        running.written = True
        return outcome

    def _settled(self, claim: Claim) -> bool:
        try:
            task = self.queue.task(claim.task_id)
        except sa.exc.DBAPIError:
            return False
        # Ours moved on (finished, failed or back to pending under our fence) or is gone.
        return task is None or not (
            task["state"] == TaskState.RUNNING and task["fence"] == claim.fence
        )

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.outcome(outcome)
