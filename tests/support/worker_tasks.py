"""Tasks for worker tests: a queue on the database clock, and tasks submitted to it."""

from __future__ import annotations

import time
from collections.abc import Iterator

from outbox import AuthContext, Envelope, TaskQueue

SOURCE = AuthContext("agent-a")


def real_time_queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the database clock (a worker's heartbeats run in real time), with retries
    far off so a failed attempt stays put; closed when the generator ends."""
    queue = TaskQueue(db_url, allowed_sources=("agent-a",), lease=2, backoff=60, backoff_cap=60)
    yield queue
    queue.close()


def submit(queue: TaskQueue, count: int) -> list[str]:
    """`count` tasks with payload {"n": i}; their ids."""
    deadline = time.time() + 3600
    return [
        queue.receive(SOURCE, Envelope(f"m-{n}", "agent-a", {"n": n}, deadline)).task_id
        for n in range(count)
    ]
