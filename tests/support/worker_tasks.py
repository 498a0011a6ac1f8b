"""Tasks for worker tests: a queue on the database clock, and tasks submitted to it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from outbox import AuthContext, Claim, Envelope, TaskQueue
from outbox.completer import HeldFinishes

SOURCE = AuthContext("agent-a")


def real_time_queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the database clock (a worker's heartbeats run in real time), with retries
    far off so a failed attempt stays put; closed when the generator ends."""
    queue = TaskQueue(db_url, allowed_sources=("agent-a",), lease=2, backoff=60, backoff_cap=60)
    yield queue
    queue.close()


def wait_until(condition: Callable[[], bool], seconds: float = 60) -> bool:
    """Poll `condition()` until true or the deadline passes."""
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while time.monotonic() < deadline:
        if condition():
            return True
        pause.wait(0.01)
    return condition()


def submit(queue: TaskQueue, count: int) -> list[str]:
    """`count` tasks with payload {"n": i}; their ids."""
    deadline = time.time() + 3600
    return [
        queue.receive(SOURCE, Envelope(f"m-{n}", "agent-a", {"n": n}, deadline)).task_id
        for n in range(count)
    ]


def before_result_writes(
    monkeypatch: pytest.MonkeyPatch,
    queue: TaskQueue,
    hook: Callable[[Sequence[tuple[Claim, Any]]], None],
) -> None:
    """Call `hook(finished)`, on a thread, before each write of results a Worker of `queue`
    makes: its batches, on either path (see outbox.completer), and its single writes.

    A hook that raises stands for a failed write; one that blocks holds the write back
    while the worker's loop goes on.
    """
    real_finish_many = queue.finish_many

    def finish_many(finished: Sequence[tuple[Claim, Any]], contexts: Any = None) -> Any:
        hook(finished)
        return real_finish_many(finished, contexts)

    # QueueFinishes and the results written alone go through finish_many.
    monkeypatch.setattr(queue, "finish_many", finish_many)
    real_held_finish = HeldFinishes.finish

    async def held_finish(
        finishes: HeldFinishes, finished: Sequence[tuple[Claim, Any]], contexts: Any = None
    ) -> Any:
        await asyncio.to_thread(hook, finished)
        return await real_held_finish(finishes, finished, contexts)

    monkeypatch.setattr(HeldFinishes, "finish", held_finish)
