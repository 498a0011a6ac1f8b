"""The worker's producer: claims tasks into free slots and keeps their leases.

It claims as many tasks as there are free slots (outbox.running: the handlers'
slots and the share claimed ahead), reconciling expired leases and deadlines a
few times per lease rather than in every claim, and hands each claim to the
executor. Between claims it waits on its event loop for a slot to free, a NOTIFY
on the tasks channel (the driver's listener, PostgreSQL), the poll interval or the
worker's stop. A heartbeat thread renews every held lease in one statement; when
a renewal is refused (the lease was lost, the task cancelled or past its
deadline) it sets that task's `stop` event: its result would be refused anyway.

A claim goes through TaskQueue on a thread of its own (TaskClaims), never
behind the writer threads (a write retried through an outage would hold up the
claims, and with them the worker's liveness), or, where the driver holds a
connection on the loop (PostgreSQL through psycopg), on it while it is one statement
(no reconciling, no tenant cap).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from functools import partial

import sqlalchemy as sa

from outbox import failpoints
from outbox.claim import Claim, claims_from_rows
from outbox.completer import finished_by_handler
from outbox.db.dialect import TASKS_NOTIFY_CHANNEL, clock_value
from outbox.drivers import driver_for
from outbox.drivers.task_interface import HeldTaskClaims
from outbox.errors import Fenced
from outbox.handler_loop import HandlerLoop, LoopWake
from outbox.observability.worker_metrics import WorkerMetrics
from outbox.running import RunningTasks
from outbox.tasks import TaskQueue
from outbox.worker_announcements import WorkerAnnouncements

log = logging.getLogger("outbox.worker")
# A claim reconciles this many times per lease: a task whose lease expired is retaken
# within a quarter lease of its expiry.
RECONCILES_PER_LEASE = 4


class TaskClaims:
    """How the producer claims: TaskQueue.claim_many on a thread of its own, or, where
    `held` is given, one-statement claims on the driver's held connection."""

    def __init__(
        self, queue: TaskQueue, loop: HandlerLoop, owner: str, held: HeldTaskClaims | None
    ) -> None:
        """Claims are leased to `owner` (a name the Worker has checked)."""
        self.queue = queue
        self.owner = owner
        self.held = held
        self.database_errors: tuple[type[Exception], ...] = (
            sa.exc.DBAPIError,
            *queue.driver.database_errors,
        )
        """What a claim raises when the database fails or cannot be reached."""
        self._loop = loop
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outbox-claims")

    async def claim(self, limit: int, reconcile: bool) -> list[Claim]:
        """Lease up to `limit` tasks, reconciling first when asked (see claim_many)."""
        if self.held is not None and self.queue.claim_is_one_statement(reconcile):
            # As claim_many's: the same statement, and the same failpoints around it.
            rows = await self.held.claim_tasks(
                owner=self.owner,
                now=clock_value(self.queue.clock),
                lease=self.queue.lease,
                limit=limit,
                window="claim.before_commit",
            )
            failpoints.hit("claim.after_commit")
            return claims_from_rows(rows)
        claim = partial(self.queue.claim_many, self.owner, limit, reconcile=reconcile)
        return await self._loop.loop.run_in_executor(self._thread, claim)

    async def close(self) -> None:
        """End the claim thread (a claim running on it ends first) and the held connection;
        the queue's own connections stay the queue's."""
        self._thread.shutdown(wait=False)
        if self.held is not None:
            await self.held.close()


def worker_claims(queue: TaskQueue, loop: HandlerLoop, owner: str) -> TaskClaims:
    """How a worker of `queue` claims: on the driver's held connection where it has one."""
    held = queue.driver.held_task_claims(queue.engine, queue.owns_engine)
    return TaskClaims(queue, loop, owner, held)


class Producer:
    """Claims into the free slots of `running`, renews their leases, wakes on NOTIFY."""

    def __init__(
        self,
        queue: TaskQueue,
        owner: str,
        loop: HandlerLoop,
        running: RunningTasks,
        start: Callable[[Claim], None],
        *,
        poll_interval: float,
        heartbeat: float,
        stopping: threading.Event,
        listening: threading.Event,
        metrics: WorkerMetrics | None = None,
        announcements: WorkerAnnouncements | None = None,
    ) -> None:
        """`start(claim)` is called on the loop for each claim (the executor's);
        `announcements`, when given, are renewed at every heartbeat."""
        self.queue = queue
        self.owner = owner
        self.metrics = metrics
        self.announcements = announcements
        self._loop = loop
        self._running = running
        self._start = start
        self.poll_interval = poll_interval
        self.heartbeat = heartbeat
        self._stopping = stopping
        self.listening = listening
        self.wake = LoopWake(loop)
        self._claims = worker_claims(queue, loop, owner)
        self.next_reconcile = 0.0  # the moment() of the next claim that reconciles
        self.last_turn = time.monotonic()
        self._beats_end = threading.Event()
        self._beats = threading.Thread(
            target=self._heartbeats, name="outbox-heartbeat", daemon=True
        )
        self._listener: asyncio.Task[None] | None = None

    def start_heartbeats(self) -> None:
        """Start renewing held leases, every `heartbeat` seconds."""
        self._beats.start()

    def end_heartbeats(self) -> None:
        """Stop renewing; returns once the heartbeat thread has ended."""
        self._beats_end.set()
        if self._beats.is_alive():
            self._beats.join()

    async def run(self) -> None:
        """Claim while slots are free, until the worker stops (on the loop)."""
        self._listen()
        while not self._stopping.is_set():
            self.last_turn = time.monotonic()
            free = self._running.free_slots()
            claims = await self._claim(free) if free > 0 else []
            for claim in claims:
                self._start(claim)
            if not claims or len(claims) == free:
                # Wait for a free slot, new work (a NOTIFY or the poll) or stop.
                await self.wake.wait(self.poll_interval)

    async def close(self) -> None:
        """Stop listening and close the claims' connections (on the loop, after the drain)."""
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        await self._claims.close()

    def _listen(self) -> None:
        """NOTIFY wake-ups on PostgreSQL; elsewhere the producer polls alone."""
        engine = self.queue.engine
        listener = driver_for(engine).listener(
            engine,
            TASKS_NOTIFY_CHANNEL,
            self.poll_interval,
            self.listening,
            on_notify=self.wake.set,
            logger=log,
        )
        if listener is not None:
            self._listener = self._loop.loop.create_task(listener.keep_listening())

    async def _claim(self, limit: int) -> list[Claim]:
        # Expired leases and deadlines matter on the scale of the lease, not of a claim:
        # reconciling in every claim cost a third of a busy worker's time.
        moment = self._moment()
        reconcile = moment >= self.next_reconcile
        try:
            claims = await self._claims.claim(limit, reconcile)
            if reconcile:
                self.next_reconcile = moment + self.queue.lease / RECONCILES_PER_LEASE
            if claims and self.metrics is not None:
                self.metrics.claimed(len(claims))
            return claims
        except self._claims.database_errors as exc:
            # Nothing was leased, or the leases expire and are taken again.
            log.warning("worker %s: claim failed (%s); trying again", self.owner, exc)
            return []

    def _moment(self) -> float:
        """Seconds on the queue's clock when it has a manual one (leases run on it), else
        on the monotonic clock."""
        return self.queue.clock() if self.queue.clock is not None else time.monotonic()

    def _heartbeats(self) -> None:
        while not self._beats_end.wait(self.heartbeat):
            try:
                self._renew()
            except Exception:  # the thread must live: it renews every lease
                # A pool checkout that timed out, say: the leases may still hold, and the
                # next beat tries again. A heartbeat thread that died would let them lapse
                # while their handlers run.
                log.exception("worker %s: lease renewal failed; trying again", self.owner)
            # After the renewals, never before: the console's list of workers must not
            # delay a lease.
            if self.announcements is not None:
                self.announcements.announce()

    def _renew(self) -> None:
        """Renew every held lease in one statement; stop the tasks whose renewal is refused."""
        running = [r for r in self._running.held() if not r.lost]
        if not running:
            return
        # Every lease in one statement: a worker may hold 2.5 x concurrency of them, and
        # one statement each could outlast the beat on a slow database.
        try:
            answers = self.queue.renew_many([entry.claim for entry in running])
        except sa.exc.SQLAlchemyError as exc:
            # The database, or a pool checkout that timed out: the leases may still hold,
            # and the next beat tries again.
            log.warning("renewal of %d leases failed (%s)", len(running), exc)
            return
        for entry, answer in zip(running, answers, strict=True):
            if not isinstance(answer, Fenced):
                continue
            if entry.written or finished_by_handler(self.queue, entry.claim):
                continue  # finished since this beat began: refused, but not lost
            entry.lost = True
            entry.halt()
            if self.metrics is not None:
                self.metrics.lease_lost()
            log.warning("task %s: renewal refused (%s); stopping it", entry.claim.task_id, answer)
