"""The worker's executor: runs the handler on a claimed task and hands its outcome on.

The handler is called as `handler(claim, stop)`: a plain function on one of
`concurrency` handler threads (outbox.handler_loop.HandlerThreads), with a
threading.Event; an `async def` awaited on the worker's event loop, with an
asyncio.Event. Either way each claimed task is a task of that loop, which waits
for a slot (a task claimed ahead waits here, its lease renewed), runs the
handler, gives the slot back as soon as the handler returns, and turns what it
returned or raised into a Completion for the completer (outbox.completer), the
one place that writes it. A task whose lease was lost before it ran is
discarded; one that has not started when the worker stops is given back.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from outbox import tracing
from outbox.claim import Claim
from outbox.completer import Completer, Completion
from outbox.handler_loop import HandlerLoop, HandlerThreads
from outbox.handlers import handler_name
from outbox.observability.worker_metrics import WorkerMetrics
from outbox.running import Running, RunningTasks

log = logging.getLogger("outbox.worker")
SYSTEM, SOURCE = "outbox", "outbox_tasks"
"""What a task run's span names as its messaging system and destination: the task table."""
Handler = Callable[[Claim, Any], Any]
"""`handler(claim, stop)`: a plain function (stop: threading.Event) or an `async def`
(stop: asyncio.Event)."""


class Executor:
    """Runs `handler` on each claim given to start(), at most `concurrency` at once."""

    def __init__(
        self,
        handler: Handler,
        is_async: bool,
        loop: HandlerLoop,
        running: RunningTasks,
        completer: Completer,
        stopping: threading.Event,
        stop_worker: Callable[[], None],
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """Plain handlers get `running.concurrency` threads; `stopping` set means no new
        handler starts; `stop_worker` is called when the handler proves of the wrong kind."""
        self.handler = handler
        self._loop = loop
        self._running = running
        self._completer = completer
        self._stopping = stopping
        self._stop_worker = stop_worker
        self.metrics = metrics
        self._slots = asyncio.Semaphore(running.concurrency)  # handlers running at once
        self._threads = None if is_async else HandlerThreads(loop, running.concurrency)
        self.misuse: str | None = None  # set when the handler proves to be of the wrong kind

    def start(self, claim: Claim) -> None:
        """Hold `claim` and run its handler once a slot is free (on the loop)."""
        running = Running(claim)
        if self._threads is None:
            running.async_stop, running.set_async_stop = self._loop.stop_event()
        self._running.add(running)
        running.task = self._loop.loop.create_task(self._execute(running))

    def close(self) -> None:
        """Idle handler threads end now, late ones once their handler returns."""
        if self._threads is not None:
            self._threads.close()

    async def _execute(self, running: Running) -> None:
        """Run the handler once a slot is free; hand its outcome to the completer."""
        claim = running.claim
        try:
            failure: Exception | None = None
            async with self._slots:  # claimed ahead: its lease is renewed while it waits
                if running.lost:
                    # Its lease was lost (or the worker gave up) before it ever ran.
                    log.warning("task %s: lease lost before it ran; discarded", claim.task_id)
                    self._count("discarded")
                    return
                if self._stopping.is_set():
                    # Stopping: only handlers already running finish; this one never ran.
                    await self._completer.give_back(running)
                    return
                started = time.perf_counter()
                try:
                    if tracing.configured():
                        result = await self._traced(running)
                    else:
                        result = await self._handled(running)
                except Exception as exc:  # noqa: BLE001 - any handler error fails the attempt
                    failure = exc
            if self._threads is not None and failure is None and inspect.isawaitable(result):
                self._refuse_awaitable(claim, result)
                return
            self._running.handler_returned(running)
            if self.metrics is not None:
                self.metrics.handled(time.perf_counter() - started)
            if failure is not None:
                await self._completer.complete(Completion(running, failure=failure))
            else:
                await self._completer.complete(Completion(running, result))
        except asyncio.CancelledError:
            if not running.lost:
                # Cancelled by something of its own, not by the end of the drain.
                log.error("task %s: handler cancelled; its lease will expire", claim.task_id)
                self._count("unrecorded")
        except (SystemExit, KeyboardInterrupt):
            # From one handler, either would otherwise leave the event loop, ending every
            # other handler with it.
            log.exception("task %s: outcome not recorded; its lease will expire", claim.task_id)
            self._count("unrecorded")
        finally:
            self._running.release(running)

    def _handled(self, running: Running, traced: bool = False) -> Awaitable[Any]:
        """The handler's run on `running`'s claim: awaited, or on a handler thread (`traced`:
        in a copy of this task's context, so that the run's span is current there too)."""
        claim = running.claim
        if self._threads is None:
            return self.handler(claim, running.async_stop)  # type: ignore[no-any-return]
        call = partial(self.handler, claim, running.stop)
        if traced:
            call = partial(contextvars.copy_context().run, call)
        return self._threads.run(call)

    async def _traced(self, running: Running) -> Any:
        """_handled in the run's span, linked to the task's creation context; the span's
        context becomes the reply's (Running.reply_context)."""
        claim = running.claim
        attributes: tracing.Attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "run",
            "messaging.destination.name": SOURCE,
            "messaging.message.id": claim.task_id,
            "outbox.task.attempt": claim.attempt,
            "outbox.task.handler": handler_name(self.handler),
        }
        contexts = [claim.creation] if claim.creation else []
        with tracing.operation(
            f"process {SOURCE}", tracing.CONSUMER, attributes, contexts, parented=False
        ) as span:
            running.reply_context = span.creation_context()
            return await self._handled(running, traced=True)

    def _refuse_awaitable(self, claim: Claim, result: object) -> None:
        """A plain handler returned a coroutine: stop the worker, write nothing for the task."""
        close = getattr(result, "close", None)
        if callable(close):
            close()  # never awaited: close it rather than leave a warning behind
        self.misuse = (
            f"handler {handler_name(self.handler)} returned {type(result).__name__} instead of "
            "a result: declare it `async def` so that the worker awaits it"
        )
        log.error("task %s: %s; stopping (its lease will expire)", claim.task_id, self.misuse)
        self._count("unrecorded")
        self._stop_worker()

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.outcome(outcome)
