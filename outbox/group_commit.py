"""Group commit: items that arrive while a write runs share the next write.

The one implementation in the toolkit, parametrised by the write: the worker's
completer commits task results with it (outbox.completer), the receiver stores
single messages with it (receiver.app). Callers are coroutines of one event loop;
each submits an item and awaits its own answer. The first item starts a writer
task; an item submitted while a batch is being written waits, on the loop and
without a thread, for the next batch, which takes everything that arrived
meanwhile (up to `max_batch`). Under load, batches grow by themselves, so a
commit and its hand-offs are shared instead of paid per item; alone, an item is
written at once.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """Writes the items submitted on one event loop in batches, one batch at a time."""

    def __init__(
        self, write: Callable[[list[T]], Awaitable[list[R]]], max_batch: int | None = None
    ) -> None:
        """`write(items)` is awaited on the loop and answers each item in order."""
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be None or >= 1, got {max_batch!r}")
        self._write = write
        self._max_batch = max_batch
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._writer: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """Items submitted and not yet taken into a batch."""
        return len(self._waiting)

    async def submit(self, item: T) -> R:
        """Write `item` with whatever else is waiting; its answer, or the batch's error."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[R] = loop.create_future()
        self._waiting.append((item, answer))
        if self._writer is None:
            # In a context of its own: the writer serves every submitter, so it must not
            # carry the first one's (its current span would parent the others' writes).
            self._writer = loop.create_task(self._write_all(), context=contextvars.Context())
        return await answer

    def _next_batch(self) -> list[tuple[T, asyncio.Future[R]]]:
        size = len(self._waiting) if self._max_batch is None else self._max_batch
        batch, self._waiting = self._waiting[:size], self._waiting[size:]
        return batch

    async def _write_all(self) -> None:
        try:
            while self._waiting:
                batch = self._next_batch()
                try:
                    answers = await self._write([item for item, _ in batch])
                    if len(answers) != len(batch):
                        raise RuntimeError(f"{len(answers)} answers for {len(batch)} items")
                except asyncio.CancelledError:  # the loop is closing: so are its submitters
                    for _, answer in batch + self._waiting:
                        answer.cancel()
                    self._waiting = []
                    raise
                except BaseException as exc:  # noqa: BLE001 - each submitter gets the error
                    # Any error, SystemExit from a writer thread included: an answer left
                    # unset would hang its submitter.
                    for _, answer in batch:
                        if not answer.done():
                            answer.set_exception(exc)
                    continue
                for (_, answer), value in zip(batch, answers, strict=True):
                    if not answer.done():  # its submitter may have been cancelled meanwhile
                        answer.set_result(value)
        finally:
            self._writer = None
