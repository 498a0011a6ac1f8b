"""Worker: claims tasks and runs a handler on them, drains on stop; wiring only.

The handler is called as `handler(claim, stop)`: a plain function on one of
`concurrency` worker threads, with a threading.Event; an `async def` as a task
on one event loop (see handler_loop), with an asyncio.Event. It returns the
result (committed with the task's reply in one transaction), raises
PermanentFailure to fail the task at once, or raises anything else to fail this
attempt (retried with backoff while attempts remain). A handler may instead
finish its task itself, in a transaction of its own with its business writes
(`finish_tx`); the worker then finds the task done under its claim and writes
nothing. A heartbeat renews every running lease; when a renewal is refused (the
lease was lost, the task cancelled or past its deadline) it sets that task's
`stop` event, and the handler should stop its side effects: its result would be
refused anyway.

Three parts do the work, each in its own module: the producer (outbox.producer)
claims into free slots, renews the leases and wakes on NOTIFY; the executor
(outbox.executor) runs the handler and turns its outcome into a completion; the
completer (outbox.completer) is where every finished task is written. The tasks
held meanwhile are in outbox.running. This module builds them, runs them on one
event loop (outbox.handler_loop), and stops them: on stop() or SIGTERM, no new
handler starts, running ones finish within the grace period, and the rest are
abandoned to lease expiry.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from outbox.completer import BatchedCompleter, batch_finishes
from outbox.errors import PermanentFailure
from outbox.executor import Executor, Handler
from outbox.handler_loop import HandlerLoop
from outbox.handlers import WrongHandlerKind, handler_name, is_async_handler
from outbox.intake import check_name
from outbox.observability.probe import Probe
from outbox.observability.worker_metrics import WorkerMetrics
from outbox.producer import Producer
from outbox.running import RunningTasks
from outbox.tasks import TaskQueue
from outbox.worker_announcements import WorkerAnnouncements

# Handler and PermanentFailure: what a handler is, and how it fails its task for good.
__all__ = ["EXIT_FORCED", "Handler", "PermanentFailure", "Worker"]

log = logging.getLogger("outbox.worker")
EXIT_FORCED = 1  # a second SIGTERM/SIGINT: exit at once
# Python runs signal handlers in the main thread only, and a signal the kernel hands to
# another of the process's threads does not interrupt the main thread's wait: run()
# waits in slices this long, so a SIGTERM is acted on whichever thread receives it.
SIGNAL_CHECK_SECONDS = 0.1


class Worker:
    """Claims tasks and runs `handler` on up to `concurrency` of them at once."""

    def __init__(
        self,
        queue: TaskQueue,
        handler: Handler,
        *,
        owner: str | None = None,
        concurrency: int = 1,
        poll_interval: float = 1.0,
        heartbeat: float | None = None,
        grace: float | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """Heartbeat defaults to a third of the lease; grace (the SIGTERM drain) to the lease.

        `metrics`, when given, counts claims, outcomes, lost leases and handler time.
        A handler that is neither a plain function nor an `async def` (a generator, a
        class, a plain wrapper returning coroutines) raises WrongHandlerKind here.
        """
        self.is_async = is_async_handler(handler)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        self.heartbeat = queue.lease / 3 if heartbeat is None else heartbeat
        self.grace = queue.lease if grace is None else grace
        for name, value in (
            ("poll_interval", poll_interval),
            ("heartbeat", self.heartbeat),
            ("grace", self.grace),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not self.heartbeat < queue.lease:
            raise ValueError("heartbeat must be shorter than the lease, or leases would lapse")
        queue.check_claims()
        self.queue = queue
        self.handler = handler
        self.owner = check_name("owner", owner or f"worker-{socket.gethostname()}-{os.getpid()}")
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self._stopping = threading.Event()
        self._running = RunningTasks(concurrency, self._wake_claims)
        self._producer: Producer | None = None  # while run() runs
        self._loop: HandlerLoop | None = None
        self.listening = threading.Event()  # set while NOTIFY wake-ups are received
        self.metrics = metrics
        self._started = time.monotonic()
        self._database_answers = Probe(queue.ping)
        if metrics is not None:
            metrics.watch(self._database_answers, lambda: len(self._running))

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop claiming (run() in another thread then drains and returns)."""
        self.stop()

    @property
    def last_turn(self) -> float:
        """The monotonic time of the producer's last turn (of the start, before one)."""
        producer = self._producer
        return self._started if producer is None else producer.last_turn

    def stop(self) -> None:
        """Stop claiming; running handlers finish within the grace period. Any thread."""
        self._stopping.set()
        self._wake_claims()

    def run(self, install_signal_handlers: bool = True) -> None:
        """Claim and handle tasks until stop() or SIGTERM/SIGINT, then drain and return.

        Handlers still running after the grace period are told to stop, and their
        outcomes are discarded; plain ones run on daemon threads, so the process can
        exit, and async ones are cancelled. Raises WrongHandlerKind, after the drain, when a
        plain handler returned a coroutine (it should have been declared `async def`).
        """
        if install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._on_signal)
        self._log_start()
        # Every claimed task is a task of one event loop, whichever the handler's kind:
        # the slot it holds frees when its handler returns, not when its result commits.
        # The claims and the batches of results run on that loop too.
        loop = self._loop = HandlerLoop()
        completer = BatchedCompleter(
            self.queue, loop, self.owner, batch_finishes(self.queue, loop), self.metrics
        )
        executor = Executor(
            self.handler,
            self.is_async,
            loop,
            self._running,
            completer,
            self._stopping,
            self.stop,
            self.metrics,
        )
        announcements = WorkerAnnouncements(
            self.queue,
            self.owner,
            handler_name(self.handler),
            self.concurrency,
            self.heartbeat,
        )
        producer = self._producer = Producer(
            self.queue,
            self.owner,
            loop,
            self._running,
            executor.start,
            poll_interval=self.poll_interval,
            heartbeat=self.heartbeat,
            stopping=self._stopping,
            listening=self.listening,
            metrics=self.metrics,
            announcements=announcements,
        )
        announcements.announce()
        producer.start_heartbeats()
        loop.start()
        claiming = loop.submit(producer.run())
        try:
            while not concurrent.futures.wait([claiming], SIGNAL_CHECK_SECONDS).done:
                pass
            claiming.result()
        finally:
            # However run() ends, an exception in this thread included (KeyboardInterrupt
            # without our signal handlers), the claims end before the drain.
            self.stop()
            self._end_claims(claiming)
            abandoned = self._drain()
            try:
                loop.submit(self._close_parts(producer, completer)).result(timeout=self.heartbeat)
            except Exception as exc:  # noqa: BLE001 - closing: the leases expire anyway
                log.warning("worker %s: connections not closed (%s)", self.owner, exc)
            loop.close(timeout=self.heartbeat)
            executor.close()
            producer.end_heartbeats()
            announcements.withdraw()
            fields = {"owner": self.owner, "drained": not abandoned, "abandoned": abandoned}
            log.info(
                "worker %s stopped: %s",
                self.owner,
                f"{abandoned} running tasks abandoned" if abandoned else "drained",
                extra={"fields": fields},
            )
        if executor.misuse is not None:
            raise WrongHandlerKind(executor.misuse)

    def _log_start(self) -> None:
        handler = handler_name(self.handler)
        kind = "async" if self.is_async else "threads"
        log.info(
            "worker %s started: concurrency %d (%s), lease %gs, handler %s",
            self.owner,
            self.concurrency,
            kind,
            self.queue.lease,
            handler,
            extra={
                "fields": {
                    "owner": self.owner,
                    "concurrency": self.concurrency,
                    "handler_kind": kind,
                    "lease": self.queue.lease,
                    "handler": handler,
                }
            },
        )

    @staticmethod
    async def _close_parts(producer: Producer, completer: BatchedCompleter) -> None:
        """Close what the parts hold on the loop: the listener and the held connections."""
        try:
            await producer.close()
        finally:
            await completer.close()

    def _end_claims(self, claiming: concurrent.futures.Future[None]) -> None:
        """Wait for the producer to end (a claim in flight completes), else cancel it."""
        try:
            claiming.result(timeout=self.heartbeat)
        except concurrent.futures.TimeoutError:
            claiming.cancel()  # its leases, if any, expire and are taken again
        except BaseException:  # noqa: BLE001, S110 - raised from run() already
            pass

    def health(self) -> dict[str, Any]:
        """Liveness for /healthz: the producer has turned recently."""
        idle = time.monotonic() - self.last_turn
        limit = max(3 * self.poll_interval, 2 * self.queue.lease)
        return {
            "ok": idle < limit,
            "owner": self.owner,
            "seconds_since_last_turn": round(idle, 3),
            "running": len(self._running),
            "listening": self.listening.is_set(),
        }

    def readiness(self) -> dict[str, Any]:
        """Readiness for /readyz: the database answers (checked at most once a second)."""
        answered = self._database_answers() is not None
        return {"ok": answered, "owner": self.owner, "database": answered}

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stopping.is_set():
            # A second signal: stop now, as the operator asks; leases expire and are retaken.
            log.warning("worker %s: second signal, exiting without draining", self.owner)
            os._exit(EXIT_FORCED)
        self.stop()

    def _wake_claims(self) -> None:
        """Let the producer look for work now (any thread)."""
        producer = self._producer
        if producer is not None:
            producer.wake.set()

    def _drain(self) -> int:
        """Let running handlers finish within the grace period; then stop and disown them.

        Returns how many were still running (abandoned to lease expiry)."""
        if not len(self._running):
            return 0
        log.info("worker %s: draining running tasks", self.owner)
        deadline = time.monotonic() + self.grace
        while True:
            if not len(self._running):
                return 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # Set once a handler's outcome is written and its slot is free.
            self._running.released.wait(min(remaining, SIGNAL_CHECK_SECONDS))
            self._running.released.clear()
        late = self._running.abandon()
        for running in late:
            if running.task is not None and self._loop is not None:
                # A closed loop has cancelled its tasks already.
                with contextlib.suppress(RuntimeError):
                    self._loop.loop.call_soon_threadsafe(running.task.cancel)
        if late:
            log.warning(
                "worker %s: abandoned %d running tasks to lease expiry", self.owner, len(late)
            )
        return len(late)
