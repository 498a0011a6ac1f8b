"""Run a handler over claimed tasks: heartbeats, fenced finish, retries, graceful stop.

The handler is called as `handler(claim, stop)`: a plain function on one of
`concurrency` worker threads, with a threading.Event; an `async def` as a task
on one event loop (see handler_loop), with an asyncio.Event. It returns the
result (committed with the task's reply in one transaction), raises
PermanentFailure to fail the task at once, or raises anything else to fail this
attempt (retried with backoff while attempts remain). A handler may instead
finish its task itself, in a transaction of its own with its business writes
(`finish_tx`); the worker then finds the task done under its claim and writes
nothing. A heartbeat thread renews every running lease; when a renewal is
refused (the lease was lost, the task cancelled or past its deadline) it sets
that task's `stop` event, and the handler should stop its side effects: its
result would be refused anyway.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import sqlalchemy as sa

from outbox.claim import Claim
from outbox.db import retry
from outbox.db.dialect import listen_conninfo
from outbox.errors import Fenced, InvalidMessage, PermanentFailure
from outbox.handler_loop import BatchedWrites, HandlerLoop, HandlerThreads, LoopWake
from outbox.handlers import WrongHandlerKind, handler_name, is_async_handler
from outbox.intake import check_name
from outbox.observability.probe import Probe
from outbox.observability.worker_metrics import WorkerMetrics
from outbox.result_group_commit import ResultGroupCommit
from outbox.states import TaskState
from outbox.task_wakeups import TaskWakeups
from outbox.tasks import TaskQueue
from outbox.worker_lanes import DATABASE_ERRORS, ThreadedLanes, worker_lanes

log = logging.getLogger("outbox.worker")
Handler = Callable[[Claim, Any], Any]
"""`handler(claim, stop)`: a plain function (stop: threading.Event) or an `async def`
(stop: asyncio.Event)."""
EXIT_FORCED = 1  # a second SIGTERM/SIGINT: exit at once
# A claim reconciles this many times per lease: a task whose lease expired is retaken
# within a quarter lease of its expiry.
RECONCILES_PER_LEASE = 4
# An async worker claims this share of `concurrency` ahead: a handler that returns is
# followed at once by a task already leased, not by a claim's round trip.
CLAIM_AHEAD = 0.5
# Python runs signal handlers in the main thread only, and a signal the kernel hands to
# another of the process's threads does not interrupt the main thread's wait: run()
# waits in slices this long, so a SIGTERM is acted on whichever thread receives it.
SIGNAL_CHECK_SECONDS = 0.1


@dataclass
class _Running:
    claim: Claim
    stop: threading.Event = field(default_factory=threading.Event)
    lost: bool = False
    written: bool = False  # its outcome is committed: a refused renewal is no news
    # An async handler's own stop event, set from other threads through this function.
    async_stop: asyncio.Event | None = None
    set_async_stop: Callable[[], None] | None = None
    task: asyncio.Task[None] | None = None  # its task on the loop, to cancel it
    busy: bool = True  # holds one of `concurrency` slots (see Worker._free_slots)

    @property
    def key(self) -> tuple[str, int]:
        """Each claim its own entry: a task lost and claimed again is held twice, briefly."""
        return (self.claim.task_id, self.claim.fence)

    def halt(self) -> None:
        """Tell the handler to stop (any thread)."""
        self.stop.set()
        if self.set_async_stop is not None:
            self.set_async_stop()


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
        self.queue = queue
        # Results that finish together commit together: one transaction per batch.
        self._results = ResultGroupCommit(queue)
        self.handler = handler
        self.owner = check_name("owner", owner or f"worker-{socket.gethostname()}-{os.getpid()}")
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self._running: dict[tuple[str, int], _Running] = {}
        self._busy = 0  # entries of _running that hold a slot
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._released = threading.Event()  # a running task was forgotten: for the drain
        self._claim_wake: LoopWake | None = None  # the claim loop's, while it runs
        self._loop: HandlerLoop | None = None
        self._beats_end = threading.Event()
        self._next_reconcile = 0.0  # the _moment() of the next claim that reconciles
        self._misuse: str | None = None  # set when the handler proves to be of the wrong kind
        self.listening = threading.Event()  # set while NOTIFY wake-ups are received
        self.metrics = metrics
        self.last_turn = time.monotonic()
        self._database_answers = Probe(queue.ping)
        if metrics is not None:
            metrics.watch(self._database_answers, lambda: len(self._running))

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop claiming (run() in another thread then drains and returns)."""
        self.stop()

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
        # Every claimed task is a task of one event loop, whichever the handler's kind:
        # the slot it holds frees when its handler returns, not when its result commits.
        # The claims and the batches of results run on that loop too (see worker_lanes).
        loop = self._loop = HandlerLoop()
        self._claim_wake = LoopWake(loop)
        lanes = worker_lanes(self.queue, loop, self.owner)
        beat = threading.Thread(target=self._heartbeats, name="outbox-heartbeat", daemon=True)
        beat.start()
        wakeups = self._wakeups()
        if wakeups is not None:
            wakeups.start()
        finishes: BatchedWrites[tuple[_Running, Any], bool] = BatchedWrites(
            loop, partial(self._finish_together, lanes)
        )
        threads = None if self.is_async else HandlerThreads(loop, self.concurrency)
        loop.start()
        claiming = loop.submit(self._claim_loop(loop, lanes, finishes, threads))
        try:
            while not concurrent.futures.wait([claiming], SIGNAL_CHECK_SECONDS).done:
                pass
            claiming.result()
        finally:
            # However run() ends, an exception in this thread included (KeyboardInterrupt
            # without our signal handlers), the claim loop ends before the drain.
            self.stop()
            self._end_claims(claiming)
            abandoned = self._drain()
            try:
                loop.submit(lanes.close()).result(timeout=self.heartbeat)
            except Exception as exc:  # noqa: BLE001 - closing: the leases expire anyway
                log.warning("worker %s: connections not closed (%s)", self.owner, exc)
            loop.close(timeout=self.heartbeat)
            if threads is not None:
                threads.close()  # idle threads end now, late ones once their handler returns
            if wakeups is not None:
                wakeups.close()
            self._beats_end.set()
            beat.join()
            fields = {"owner": self.owner, "drained": not abandoned, "abandoned": abandoned}
            log.info(
                "worker %s stopped: %s",
                self.owner,
                f"{abandoned} running tasks abandoned" if abandoned else "drained",
                extra={"fields": fields},
            )
        if self._misuse is not None:
            raise WrongHandlerKind(self._misuse)

    async def _claim_loop(
        self,
        loop: HandlerLoop,
        lanes: ThreadedLanes,
        finishes: BatchedWrites[tuple[_Running, Any], bool],
        threads: HandlerThreads | None,
    ) -> None:
        """Claim while slots are free, each claim a task of the loop, until stop()."""
        slots = asyncio.Semaphore(self.concurrency)  # handlers running at once
        wake = self._claim_wake
        assert wake is not None  # set by run() before the loop starts
        while not self._stopping.is_set():
            self.last_turn = time.monotonic()
            free = self._free_slots()
            claims = await self._claim(lanes, free) if free > 0 else []
            for claim in claims:
                running = _Running(claim)
                if threads is None:
                    running.async_stop, running.set_async_stop = loop.stop_event()
                with self._lock:
                    self._running[running.key] = running
                    self._busy += 1
                running.task = loop.loop.create_task(
                    self._handle(loop, finishes, slots, threads, running)
                )
            if not claims or len(claims) == free:
                # Wait for a free slot, new work (a NOTIFY or the poll) or stop.
                await wake.wait(self.poll_interval)

    def _end_claims(self, claiming: concurrent.futures.Future[None]) -> None:
        """Wait for the claim loop to end (a claim in flight completes), else cancel it."""
        try:
            claiming.result(timeout=self.heartbeat)
        except concurrent.futures.TimeoutError:
            claiming.cancel()  # its leases, if any, expire and are taken again
        except BaseException:  # noqa: BLE001, S110 - raised from run() already
            pass

    def health(self) -> dict[str, Any]:
        """Liveness for /healthz: the claim loop has turned recently."""
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

    async def _claim(self, lanes: ThreadedLanes, limit: int) -> list[Claim]:
        # Expired leases and deadlines matter on the scale of the lease, not of a claim:
        # reconciling in every claim cost a third of a busy worker's time.
        moment = self._moment()
        reconcile = moment >= self._next_reconcile
        try:
            claims = await lanes.claim(limit, reconcile)
            if reconcile:
                self._next_reconcile = moment + self.queue.lease / RECONCILES_PER_LEASE
            if claims and self.metrics is not None:
                self.metrics.claimed(len(claims))
            return claims
        except DATABASE_ERRORS as exc:
            # Nothing was leased, or the leases expire and are taken again.
            log.warning("worker %s: claim failed (%s); trying again", self.owner, exc)
            return []

    def _wakeups(self) -> TaskWakeups | None:
        """NOTIFY wake-ups on PostgreSQL; elsewhere the loop polls alone."""
        conninfo = listen_conninfo(self.queue.engine)
        if conninfo is None:
            return None
        return TaskWakeups(conninfo, self._wake_claims, self.poll_interval, self.listening)

    def _wake_claims(self) -> None:
        """Let the claim loop look for work now (any thread)."""
        wake = self._claim_wake
        if wake is not None:
            wake.set()

    def _moment(self) -> float:
        """Seconds on the queue's clock when it has a manual one (leases run on it), else
        on the monotonic clock."""
        return self.queue.clock() if self.queue.clock is not None else time.monotonic()

    def _drain(self) -> int:
        """Let running handlers finish within the grace period; then stop and disown them.

        Returns how many were still running (abandoned to lease expiry)."""
        with self._lock:
            if not self._running:
                return 0
        log.info("worker %s: draining running tasks", self.owner)
        deadline = time.monotonic() + self.grace
        while True:
            with self._lock:
                if not self._running:
                    return 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # Set once a handler's outcome is written and its slot is free.
            self._released.wait(min(remaining, SIGNAL_CHECK_SECONDS))
            self._released.clear()
        with self._lock:
            late = list(self._running.values())
            for running in late:
                # Heartbeats end now: another worker may take the task, so nothing of
                # this one's may be written any more.
                running.lost = True
                running.halt()
                if running.task is not None and self._loop is not None:
                    # A closed loop has cancelled its tasks already.
                    with contextlib.suppress(RuntimeError):
                        self._loop.loop.call_soon_threadsafe(running.task.cancel)
        if late:
            log.warning(
                "worker %s: abandoned %d running tasks to lease expiry", self.owner, len(late)
            )
        return len(late)

    async def _handle(
        self,
        loop: HandlerLoop,
        finishes: BatchedWrites[tuple[_Running, Any], bool],
        slots: asyncio.Semaphore,
        threads: HandlerThreads | None,
        running: _Running,
    ) -> None:
        """Run the handler once a slot is free (on `threads` for a plain one); settle."""
        claim = running.claim
        try:
            failure: Exception | None = None
            async with slots:  # claimed ahead: its lease is renewed while it waits
                if running.stop.is_set():
                    # Its lease was lost (or the worker gave up) before it ever ran.
                    log.warning("task %s: lease lost before it ran; discarded", claim.task_id)
                    self._count("discarded")
                    return
                if self._stopping.is_set():
                    # Stopping: only handlers already running finish; this one never ran.
                    await loop.write(partial(self._give_back, running))
                    return
                started = time.perf_counter()
                try:
                    if threads is None:
                        result = await self.handler(claim, running.async_stop)
                    else:
                        result = await threads.run(partial(self.handler, claim, running.stop))
                except Exception as exc:  # noqa: BLE001 - any handler error fails the attempt
                    failure = exc
            if threads is not None and failure is None and inspect.isawaitable(result):
                self._refuse_awaitable(claim, result)
                return
            self._handler_returned(running)
            self._handled(started)
            if failure is not None:
                write = partial(self._fail, claim, failure)
            elif await finishes.submit((running, result)):
                return  # committed with the results that finished meanwhile
            else:
                write = partial(self._finish, claim, result)
            # Writes block: on a writer thread, while the other handlers go on.
            await loop.write(partial(self._settle, running, write))
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
            self._release(running)

    def _give_back(self, running: _Running) -> None:
        """Release a task claimed ahead that will not run here: another worker takes it."""
        try:
            released = self.queue.release(running.claim)
        except sa.exc.DBAPIError as exc:
            log.warning(
                "task %s: not given back (%s); its lease will expire", running.claim.task_id, exc
            )
            self._count("unrecorded")
            return
        self._count("released" if released else "discarded")

    def _refuse_awaitable(self, claim: Claim, result: object) -> None:
        """A plain handler returned a coroutine: stop the worker, write nothing for the task."""
        close = getattr(result, "close", None)
        if callable(close):
            close()  # never awaited: close it rather than leave a warning behind
        self._misuse = (
            f"handler {handler_name(self.handler)} returned {type(result).__name__} instead of "
            "a result: declare it `async def` so that the worker awaits it"
        )
        log.error("task %s: %s; stopping (its lease will expire)", claim.task_id, self._misuse)
        self._count("unrecorded")
        self.stop()

    def _free_slots(self) -> int:
        """Tasks to claim now.

        A slot (a plain handler's thread, or an async handler's turn) is free once
        the handler returns: its result waits for the next group commit while another
        task runs, since a turn spent waiting for a commit and then a claim would
        leave the slot idle. The worker also holds CLAIM_AHEAD of `concurrency`
        claimed and waiting for a slot (their leases renewed like the others'; given
        back unrun if the worker stops). All held leases, results waiting for their
        commit included, stay within 2.5 x `concurrency`, so a slow database stops
        the claims.
        """
        ahead = int(self.concurrency * CLAIM_AHEAD)
        with self._lock:
            return min(
                self.concurrency + ahead - self._busy,
                2 * self.concurrency + ahead - len(self._running),
            )

    def _handler_returned(self, running: _Running) -> None:
        """A handler is done: its slot may take the next task (any thread)."""
        with self._lock:
            if not running.busy:
                return
            running.busy = False
            self._busy -= 1
        self._wake_claims()

    def _release(self, running: _Running) -> None:
        """Forget the running task (its outcome is settled) and wake the claim loop."""
        with self._lock:
            if self._running.pop(running.key, None) is not None and running.busy:
                running.busy = False
                self._busy -= 1
        self._released.set()
        self._wake_claims()

    def _handled(self, started: float) -> None:
        if self.metrics is not None:
            self.metrics.handled(time.perf_counter() - started)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.outcome(outcome)

    def _lease_lost(self) -> None:
        if self.metrics is not None:
            self.metrics.lease_lost()

    def _finish(self, claim: Claim, result: Any) -> str:
        try:
            self._results.finish(claim, result)
        except InvalidMessage as exc:
            # The result cannot be stored (not JSON, too large): running the handler again
            # would repeat its side effects for the same refusal.
            self.queue.fail(claim, f"result refused: {exc}", permanent=True)
            log.error("task %s: result refused (%s); failed", claim.task_id, exc)
            return "failed"
        return "done"

    async def _finish_together(
        self, lanes: ThreadedLanes, finished: list[tuple[_Running, Any]]
    ) -> list[bool]:
        """Commit handlers' results in one transaction; per result, whether it was.

        The common case only: a result not committed here (its lease lost, the result
        refused, a database error) is then settled alone, as a plain handler's is, by
        _settle, which writes again or reads the task to learn what happened.
        """
        held = [(running, result) for running, result in finished if not running.lost]
        if not held:
            return [False] * len(finished)
        try:
            written = await lanes.finish([(r.claim, result) for r, result in held])
        except Exception as exc:  # noqa: BLE001 - nothing known committed: each is settled alone
            log.warning(
                "worker %s: %d results not committed together (%s); writing each alone",
                self.owner,
                len(held),
                exc,
            )
            return [False] * len(finished)
        committed = set()
        for (running, _), was_written in zip(held, written, strict=True):
            if was_written:
                running.written = True
                committed.add(running.key)
                self._count("done")
        return [running.key in committed for running, _ in finished]

    def _fail(self, claim: Claim, exc: Exception) -> str:
        reason = f"{type(exc).__name__}: {exc}"
        state = self.queue.fail(claim, reason, permanent=isinstance(exc, PermanentFailure))
        log.info("task %s attempt %d failed (%s): %s", claim.task_id, claim.attempt, state, reason)
        return "retry" if state == TaskState.PENDING else state

    def _settle(self, running: _Running, write: Callable[[], str]) -> None:
        """Commit the handler's outcome unless the lease is gone; re-read after an error."""
        if running.lost:
            if self._finished_by_handler(running.claim):
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
            if self._finished_by_handler(running.claim):
                self._count("done")  # with finish_tx, in the handler's own transaction
                return
            log.warning("task %s: %s; outcome discarded", task_id, exc)
            self._lease_lost()
            self._count("discarded")
            return
        except sa.exc.DBAPIError:
            log.error("task %s: outcome not recorded; its lease will expire", task_id)
            self._count("unrecorded")
            return
        # None: a write whose COMMIT answer was lost, found done when the task was re-read.
        self._count("unknown" if outcome is None else outcome)

    @staticmethod
    def _write(running: _Running, write: Callable[[], str]) -> str:
        outcome = write()
        running.written = True
        return outcome

    def _finished_by_handler(self, claim: Claim) -> bool:
        """Whether the handler finished its task itself: `done` under this very claim.

        Only this claim's finish can write `done` with its fence: a later claim
        takes a new fence, and a reaped task is pending, not done.
        """
        try:
            task = self.queue.task(claim.task_id)
        except sa.exc.DBAPIError:
            return False
        return task is not None and task["state"] == TaskState.DONE and task["fence"] == claim.fence

    def _settled(self, claim: Claim) -> bool:
        try:
            task = self.queue.task(claim.task_id)
        except sa.exc.DBAPIError:
            return False
        # Ours moved on (finished, failed or back to pending under our fence) or is gone.
        return task is None or not (
            task["state"] == TaskState.RUNNING and task["fence"] == claim.fence
        )

    def _heartbeats(self) -> None:
        while not self._beats_end.wait(self.heartbeat):
            with self._lock:
                running = [r for r in self._running.values() if not r.lost]
            if not running:
                continue
            # Every lease in one statement: a worker may hold 2.5 x concurrency of them, and
            # one statement each could outlast the beat on a slow database.
            try:
                answers = self.queue.renew_many([entry.claim for entry in running])
            except sa.exc.DBAPIError as exc:
                # The leases may still hold: the next beat tries again.
                log.warning("renewal of %d leases failed (%s)", len(running), exc)
                continue
            for entry, answer in zip(running, answers, strict=True):
                if not isinstance(answer, Fenced):
                    continue
                if entry.written or self._finished_by_handler(entry.claim):
                    continue  # finished since this beat began: refused, but not lost
                entry.lost = True
                entry.halt()
                self._lease_lost()
                log.warning(
                    "task %s: renewal refused (%s); stopping it", entry.claim.task_id, answer
                )
