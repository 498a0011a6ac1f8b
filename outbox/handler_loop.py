"""The event loop that runs a worker's `async def` handlers, each as a task.

Handlers that mostly wait (an HTTP call, a model's answer) then cost a task each,
not a thread each, so a worker can hold hundreds of them. What blocks stays off
the loop: the worker's writes (results, failures) run on a small pool of threads,
where concurrent results still share one commit (ResultGroupCommit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
# Threads that write outcomes: the group commit batches whatever waits, so a few
# threads keep up with hundreds of handlers finishing at once.
WRITER_THREADS = 8


class HandlerLoop:
    """An event loop on a thread of its own, and the threads its handlers write through."""

    def __init__(self, writer_threads: int = WRITER_THREADS) -> None:
        """Nothing runs until start()."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="outbox-async-handlers", daemon=True)
        self._writers = concurrent.futures.ThreadPoolExecutor(
            writer_threads, thread_name_prefix="outbox-writer"
        )

    def start(self) -> None:
        """Start the loop's thread."""
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        """Run `coroutine` as a task on the loop (from any thread); its future cancels it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop_event(self) -> tuple[asyncio.Event, Callable[[], None]]:
        """An event for a handler to await, and a function that sets it from any thread."""
        event = asyncio.Event()

        def set_event() -> None:
            # A closed loop has no handler left to tell.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(event.set)

        return event, set_event

    async def write(self, write: Callable[[], T]) -> T:
        """Run a blocking write on a writer thread; the loop goes on meanwhile."""
        return await self.loop.run_in_executor(self._writers, write)

    def close(self, timeout: float) -> None:
        """Stop the loop (tasks still running are abandoned) and let the writers finish."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        self._writers.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            # Handlers still running were abandoned (their outcomes are discarded):
            # cancel them so their cleanup runs, for as long as close() waits.
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.wait(left, timeout=1.0))
        finally:
            self.loop.close()
