"""Group commit: results finished at about the same time share one transaction.

A worker's handlers finish on their own threads. Each one hands its result to
ResultGroupCommit.finish and waits; the first to arrive writes every result waiting
at that moment with TaskQueue.finish_many, then passes the pen to the next
waiting thread, if any, and returns. Each result is still committed with its
reply and checked against its own lease and fence; only the COMMIT is shared.
Under load this turns one transaction per task into one per batch; alone, a
result is written at once, as TaskQueue.finish would.

For Worker's handler threads: a thread waiting here must not be interrupted
(a signal handler raising in the main thread, say), since the next batch may
be its to write.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from outbox.claim import Claim
from outbox.tasks import TaskQueue


@dataclass
class _Waiting:
    claim: Claim
    result: Any
    # Set when the outcome is known, or when this thread is to write the next batch.
    wake: threading.Event = field(default_factory=threading.Event)
    written: bool = False
    error: BaseException | None = None


class ResultGroupCommit:
    """Commits results from many threads in shared transactions, one batch at a time."""

    def __init__(self, queue: TaskQueue) -> None:
        """Write through `queue`."""
        self.queue = queue
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []
        self._writing = False

    def finish(self, claim: Claim, result: Any) -> None:
        """Commit `done`, the result and its reply; raises what TaskQueue.finish would."""
        mine = _Waiting(claim, result)
        with self._lock:
            self._waiting.append(mine)
            leading = not self._writing
            self._writing = True
        if not leading:
            mine.wake.wait()
        if not mine.written:
            self._write_batch()
        if mine.error is not None:
            raise mine.error

    def _write_batch(self) -> None:
        with self._lock:
            batch, self._waiting = self._waiting, []
        refused: list[BaseException | None]
        try:
            refused = list(self.queue.finish_many([(w.claim, w.result) for w in batch]))
        except BaseException as exc:  # noqa: BLE001 - nothing committed: each caller decides
            refused = [exc] * len(batch)
        for waiting, error in zip(batch, refused, strict=True):
            waiting.error = error
            waiting.written = True
        with self._lock:
            successor = self._waiting[0] if self._waiting else None
            self._writing = successor is not None
        # Outcomes first, then the next writer: its batch is whatever arrived meanwhile.
        for waiting in batch:
            waiting.wake.set()
        if successor is not None:
            successor.wake.set()
