"""The event loop that runs a worker's claimed tasks, each as a task of the loop.

An `async def` handler is awaited on the loop: handlers that mostly wait (an HTTP
call, a model's answer) then cost a task each, not a thread each, so a worker can
hold hundreds of them. A plain handler runs on one of `concurrency` daemon threads
(HandlerThreads) while its task awaits it. Either way, what follows the handler is
the same: results that finish together are written together by the completer's
group commit, a coroutine of the loop (see outbox.completer), and what blocks
(failures, results written alone, all writes on SQLite) runs on a small pool of
writer threads. Results wait on the loop, not on a thread each, so a batch holds
whatever finished while the previous one was written, however many handlers that
is, and a handler's thread takes its next task while its result is committed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from queue import SimpleQueue
from typing import Any, TypeVar

T = TypeVar("T")
# Threads that write outcomes that block: failures, the results a batch could not commit,
# and (where the batches are not written on the loop) the batches, one at a time.
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

    @property
    def thread_id(self) -> int | None:
        """The identifier of the loop's thread, once started."""
        return self._thread.ident

    def start(self) -> None:
        """Start the loop's thread."""
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` as a task on the loop (from any thread); its future gives its
        result and cancels it."""
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


class LoopCall:
    """Runs `callback` on a loop soon after request(), from any thread; requests made while
    one call is queued fold into it.

    call_soon_threadsafe wakes the loop through a write to its self-pipe: once per
    request, a burst of them costs as many wake-ups and loop turns as it has requests.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        """Nothing is queued yet."""
        self._loop = loop
        self._callback = callback
        self._lock = threading.Lock()
        self._queued = False

    def request(self) -> None:
        """Queue the call unless one is queued already (any thread)."""
        with self._lock:
            if self._queued:
                return
            self._queued = True
        # A closed loop has nobody left to call.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        # Cleared before the call: a request made while it runs queues the next one.
        with self._lock:
            self._queued = False
        self._callback()


class LoopWake:
    """Wakes one coroutine of a HandlerLoop; set() from any thread, at most one call queued.

    The producer waits here for a free slot, a NOTIFY or stop(). Handlers end on the
    loop and set it there directly; other threads' calls are folded into one queued
    call, so a burst of notifications costs the loop one wake-up, not one each.
    """

    def __init__(self, loop: HandlerLoop) -> None:
        """Nothing is waiting yet."""
        self._loop = loop
        self._event = asyncio.Event()
        self._from_threads = LoopCall(loop.loop, self._event.set)

    def set(self) -> None:
        """Wake the waiter, or let its next wait() return at once (any thread)."""
        if threading.get_ident() == self._loop.thread_id:
            self._event.set()
        else:
            self._from_threads.request()

    async def wait(self, timeout: float) -> None:
        """Return once set (then clear it) or after `timeout` seconds (on the loop)."""
        if not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout)
        self._event.clear()


class HandlerThreads:
    """Daemon threads that run plain handlers for tasks on a HandlerLoop, one call each.

    Daemon, so that a handler that never returns cannot keep the process from
    exiting once the worker has given up on it. Started once: a thread per task
    cost a tenth of a busy worker's CPU. The answers reach the loop together: the
    calls that return while the loop is busy are answered in one turn of it.
    """

    def __init__(self, loop: HandlerLoop, count: int, name: str = "outbox-handler") -> None:
        """Start `count` threads named `<name>-1` .. `<name>-<count>`."""
        self._loop = loop.loop
        self._count = count
        self._closed = False
        self._calls: SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None]
        self._calls = SimpleQueue()
        # (future, whether it raised, its result or exception), in the order they returned.
        self._answers: deque[tuple[asyncio.Future[Any], bool, Any]] = deque()
        self._answering = LoopCall(self._loop, self._settle)
        for n in range(count):
            threading.Thread(target=self._serve, name=f"{name}-{n + 1}", daemon=True).start()

    async def run(self, call: Callable[[], T]) -> T:
        """Run `call` on a free thread (the caller keeps at most `count` running); its result.

        A call the thread raises from, BaseException included, raises here. Cancelling
        the caller does not stop the call: it runs to its end and its result is dropped.
        """
        answer: asyncio.Future[T] = self._loop.create_future()
        self._calls.put((call, answer))
        return await answer

    def close(self) -> None:
        """Idle threads end now, busy ones when their call returns; queued calls never run."""
        self._closed = True
        for _ in range(self._count):
            self._calls.put(None)

    def _serve(self) -> None:
        while (queued := self._calls.get()) is not None:
            call, answer = queued
            if self._closed:
                continue  # the worker gave up on it before it started
            try:
                value = call()
            except StopIteration as exc:
                # A future cannot hold StopIteration (it ends coroutines): as PEP 479 does
                # for generators, it arrives as the RuntimeError it stands for.
                failed = RuntimeError(f"handler raised StopIteration: {exc}")
                failed.__cause__ = exc
                self._answers.append((answer, True, failed))
            except BaseException as exc:  # noqa: BLE001 - the awaiting task decides
                self._answers.append((answer, True, exc))
            else:
                self._answers.append((answer, False, value))
            self._answering.request()

    def _settle(self) -> None:
        """Answer every call returned so far (on the loop)."""
        answers = self._answers
        while answers:
            answer, raised, value = answers.popleft()
            if answer.done():
                continue  # its task was cancelled meanwhile
            if raised:
                answer.set_exception(value)
            else:
                answer.set_result(value)
