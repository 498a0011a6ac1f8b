"""The relay loop: claim -> deliver (bounded concurrency) -> settle, until told to stop.

Database work (relay.leases) is short synchronous transactions run off the
event loop; delivery (relay.dispatch) runs each destination's transport on
this loop. The loop keeps a claim and up to PIPELINE deliveries per
destination in flight, and settles each part on its own.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import failpoints
from outbox.clock import Clock
from outbox.db.dialect import NOTIFY_CHANNEL
from outbox.db.handle import DatabaseHandle
from outbox.drivers import driver_for
from outbox.observability.probe import Probe
from relay.config import Destination, check_destinations, check_relay_settings
from relay.dispatch import Dispatcher, Turn
from relay.event_loop import (
    cancel_remaining,
    done_unless_stopped,
    new_event_loop,
    stopping_on_signals,
)
from relay.leases import RelayLeases
from relay.metrics import RelayMetrics
from relay.pipeline import Claimed, Pipeline, by_destination
from relay.policy import Verdict, retry_window
from relay.transports import check_kinds
from relay.turn_report import report_turn

log = logging.getLogger("outbox.relay")
LEASE_MARGIN = 0.5  # seconds: the last attempt of a turn must end this long before the lease


class Relay(DatabaseHandle):
    """A fenced relay: leases outbox messages and delivers them with backoff."""

    _claims_rows = True

    def __init__(
        self,
        url_or_engine: str | sa.URL | Engine,
        destinations: Mapping[str, Destination],
        owner: str | None = None,
        clock: Clock | None = None,
        lease: float = 30,
        backoff: float = 2,
        max_attempts: int = 3,
        batch: int = 100,
        concurrency: int = 32,
        backoff_cap: float = 300,
        poll_interval: float = 1.0,
        grace: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """Validate the configuration and open the database (schema must be current)."""
        self.destinations = check_destinations(destinations)
        check_kinds(self.destinations)
        owner = check_relay_settings(
            self.destinations,
            owner=owner,
            lease=lease,
            counts={"max_attempts": max_attempts, "batch": batch, "concurrency": concurrency},
            backoff=backoff,
            backoff_cap=backoff_cap,
            poll_interval=poll_interval,
        )
        self.owner = owner
        self.clock = clock
        self.lease = float(lease)
        self.backoff = float(backoff)
        self.backoff_cap = float(backoff_cap)
        self.max_attempts = max_attempts
        self.batch = batch
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.grace = self.lease if grace is None else grace
        # No ping per checkout: a dropped connection fails a statement, which the claim and
        # settle retries handle on a fresh one; a ping would cost a round trip per turn.
        self._open(url_or_engine, pool_pre_ping=False)
        self.leases = RelayLeases(
            self._engine,
            owner=owner,
            destinations=list(self.destinations),
            # A claim may wait for a whole lease behind full pipelines, then a poll.
            announce_for=2 * self.lease + poll_interval,
            lease=self.lease,
            batch=batch,
            max_attempts=max_attempts,
            backoff=self.backoff,
            backoff_cap=self.backoff_cap,
            clock=clock,
            rng=rng,
        )
        self._loop = new_event_loop()
        self._stopping: asyncio.Event | None = None
        # Set when a settle frees an ordering key (its message sent or dead): the key's
        # next message is claimable at once, and nothing else (no NOTIFY, no backlog)
        # would wake the loop before the next poll.
        self._key_freed: asyncio.Event | None = None
        # Turns whose settle failed: their outcomes are known and recorded before the next
        # claim, never sent again.
        self._unsettled: list[Turn] = []
        self.listening = threading.Event()
        """Set while a LISTEN connection is up (PostgreSQL), so NOTIFY wakes the loop."""
        self.delivering = threading.Event()
        """Set while run() delivers: from its retention check passed until it stops claiming."""
        self.metrics = RelayMetrics(self.leases.figures, self.destinations)
        self._database_answers = Probe(self.ping)
        self.dispatcher = Dispatcher(
            self.destinations,
            concurrency=concurrency,
            max_attempts=max_attempts,
            metrics=self.metrics,
        )

    # --- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Close HTTP clients and, when the relay created it, the connection pool."""
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.run_until_complete(self.dispatcher.close())
            cancel_remaining(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            # A settle abandoned at shutdown may still run in a worker thread: let it end
            # before the engine goes away under it.
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
        leases = getattr(self, "leases", None)
        if leases is not None:
            leases.close()
            try:
                leases.withdraw()
            except Exception as exc:  # noqa: BLE001 - closing goes on: the pool must be released
                # Not fatal: the announcement lapses on its own.
                log.warning("relay %s: could not withdraw its destinations (%s)", self.owner, exc)
        super().close()

    def dispatch_once(self) -> list[tuple[str, Verdict]]:
        """Claim one batch, deliver and settle each destination's part; (reply_id, verdict)
        per message."""
        return self._loop.run_until_complete(self._dispatch())

    def run(self, install_signal_handlers: bool = True) -> None:
        """Deliver until SIGTERM/SIGINT (or stop()), then drain in-flight work and return."""
        self._loop.run_until_complete(self._run(install_signal_handlers))

    def stop(self) -> None:
        """Ask a running relay to stop claiming and drain; safe from any thread."""
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    # --- the loop ---------------------------------------------------------------

    async def _run(self, install_signal_handlers: bool) -> None:
        self._stopping = stopping = asyncio.Event()
        self._key_freed = asyncio.Event()
        with stopping_on_signals(self._loop, stopping.set, install_signal_handlers):
            await self._serve(stopping, self._key_freed)

    async def _serve(self, stopping: asyncio.Event, key_freed: asyncio.Event) -> None:
        stop = asyncio.ensure_future(stopping.wait())
        try:
            # A destination that accepts and never answers holds the retention check for
            # its whole timeout, up to the lease: a stop must not wait for it.
            checked = await done_unless_stopped(self.check_retention(), stop)
        except BaseException:
            stop.cancel()
            raise
        if not checked:
            stop.cancel()
            log.info("relay %s stopped before it started", self.owner)
            return
        # NOTIFY wake-ups on PostgreSQL; SQLite has none and polls.
        wakeups = driver_for(self._engine).listener(
            self._engine, NOTIFY_CHANNEL, self.poll_interval, self.listening, logger=log
        )
        listener = None if wakeups is None else asyncio.ensure_future(wakeups.keep_listening())
        log.info("relay %s started", self.owner)
        self.delivering.set()
        # A claimed batch is split by destination, and each part is delivered and settled
        # on its own, so a destination that hangs holds up only its own replies. The next
        # claim does not wait for the previous POST: behind a backlog (the last claim was
        # full) it starts at once, otherwise at the next NOTIFY or poll, or as soon as a
        # settle frees an ordering key, whose next message waits for it. A destination
        # with PIPELINE parts posting is left out of claims, so what arrives while both
        # are out goes in one later part, not many tiny ones, and a hung destination
        # cannot stop the others' claims. Claims skip keys with a message in flight, so
        # per-key order holds.
        flying: set[asyncio.Future[None]] = set()  # parts delivering or settling
        pipelines: dict[str, Pipeline] = defaultdict(Pipeline)
        backlog = False
        try:
            while not stopping.is_set():
                flying = {f for f in flying if not f.done()}
                busy = {name for name in self.destinations if pipelines[name].full()}
                if busy == set(self.destinations):
                    waits: set[asyncio.Future[Any]] = {*flying, stop}
                    for pipeline in pipelines.values():
                        waits |= pipeline.posting
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    continue
                # Cleared before claiming: a NOTIFY or a freed key that lands mid-claim
                # wakes the next turn.
                key_freed.clear()
                if wakeups is not None:
                    await wakeups.clear()
                work = asyncio.ensure_future(self._claim_next(flying, busy))
                await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done():
                    flying.add(asyncio.ensure_future(self._finish_claim(work)))
                    break
                try:
                    claimed = work.result()
                except Exception:
                    # A failed claim leased nothing, or is adopted next time; go on.
                    log.exception("relay %s turn failed; trying again next turn", self.owner)
                    claimed = None
                self.metrics.last_turn = time.monotonic()
                backlog = claimed is not None and len(claimed[0]) + len(claimed[1]) >= self.batch
                for name, part in [] if claimed is None else by_destination(claimed):
                    delivered: asyncio.Future[None] = self._loop.create_future()
                    turn = asyncio.ensure_future(self._deliver_and_record(part, delivered))
                    pipelines[name].add(delivered, turn)
                    flying.add(turn)
                if backlog:
                    continue  # more is probably waiting
                waiter = asyncio.ensure_future(
                    asyncio.sleep(self.poll_interval)
                    if wakeups is None
                    else wakeups.wait(self.poll_interval)
                )
                freed = asyncio.ensure_future(key_freed.wait())
                waits = {waiter, freed, stop}
                # A destination left out of this claim as busy is claimed for again as soon
                # as one of its parts ends: a key it freed meanwhile, or a NOTIFY for it,
                # was spent on this claim.
                for name in busy:
                    waits |= pipelines[name].posting | pipelines[name].unfinished
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                freed.cancel()
        finally:
            self.delivering.clear()
            await self._land(flying)
            stop.cancel()
            if listener is not None:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
            log.info("relay %s stopped", self.owner)

    async def check_retention(self) -> None:
        """Refuse to run when a destination keeps receipts shorter than our retry window."""
        await self.dispatcher.check_retention(
            retry_window(self.max_attempts, self.backoff, self.backoff_cap, self.lease)
        )

    async def _dispatch(self) -> list[tuple[str, Verdict]]:
        await self._record_unsettled()
        claimed = await self._claim_batch()
        if claimed is None:
            return []
        # As in run(): each destination's part is delivered and settled on its own, so a
        # slow destination holds up only its own messages' settle.
        parts = await asyncio.gather(
            *(self._deliver_and_settle(part) for _, part in by_destination(claimed)),
            return_exceptions=True,
        )
        verdicts: list[tuple[str, Verdict]] = []
        for part in parts:
            if isinstance(part, BaseException):
                raise part
            verdicts.extend(part)
        return verdicts

    async def _deliver_and_settle(self, part: Claimed) -> list[tuple[str, Verdict]]:
        return await self._record(await self.dispatcher.deliver_batch(*part))

    async def _claim_next(
        self, flying: set[asyncio.Future[None]], busy: set[str]
    ) -> Claimed | None:
        """run()'s claim, without `busy` destinations; adopt only with nothing in flight."""
        if self.leases.claim_in_doubt and flying:
            # Adoption re-leases every row this owner holds, in-flight turns' rows included.
            await asyncio.wait(flying)
        await self._record_unsettled()
        # Decided now, not when a retry of this claim finds itself in doubt: by then other
        # turns may be posting rows that adoption would lease again and send twice.
        return await self._claim_batch(busy, may_adopt=not flying)

    async def _finish_claim(self, work: asyncio.Future[Claimed | None]) -> None:
        """At shutdown: a claim still running is delivered and settled if it lands in time."""
        try:
            claimed = await work
        except Exception:
            log.exception("relay %s claim failed at shutdown", self.owner)
            return
        if claimed is not None:
            await self._deliver_and_record(claimed, self._loop.create_future())

    async def _deliver_and_record(self, claimed: Claimed, delivered: asyncio.Future[None]) -> None:
        try:
            turn = await self.dispatcher.deliver_batch(*claimed)
        except Exception:
            # Nothing known to settle: the rows' leases expire and they are taken again.
            log.exception("relay %s delivery failed; its leases will expire", self.owner)
            return
        finally:
            if not delivered.done():
                delivered.set_result(None)
        try:
            await self._record(turn)
        except Exception:
            log.exception("relay %s settle failed; trying again next turn", self.owner)

    async def _land(self, flying: set[asyncio.Future[None]]) -> None:
        """Give in-flight turns the grace period, then abandon them to lease expiry."""
        if not flying:
            return
        _, late = await asyncio.wait(flying, timeout=self.grace)
        for future in late:
            future.cancel()
        if late:
            await asyncio.wait(late)
            log.warning("relay %s abandoned in-flight work at shutdown", self.owner)

    async def _record_unsettled(self) -> None:
        for turn in list(self._unsettled):
            await self._record(turn)

    async def _claim_batch(
        self, busy: Collection[str] = (), may_adopt: bool = True
    ) -> Claimed | None:
        """Lease a batch: (messages to deliver, messages to resolve, the turn's deadline)."""
        started = time.monotonic()
        try:
            deliver, resolve = await asyncio.to_thread(self.leases.claim, busy, may_adopt)
        except Exception:
            self.metrics.database_error("claim")
            raise
        if not deliver and not resolve:
            return None
        self.metrics.claimed(m.destination for m in (*deliver, *resolve))
        failpoints.hit("relay.after_claim")
        # The lease runs from the claim: an attempt that could not finish before it ends is
        # not started, or another relay might send the same message at the same time.
        return Claimed(deliver, resolve, started + self.lease - LEASE_MARGIN)

    async def _record(self, turn: Turn) -> list[tuple[str, Verdict]]:
        everything, outcomes, unattempted, looked_up, failures = turn
        try:
            settled = await asyncio.to_thread(
                self.leases.settle, everything, outcomes, unattempted, failures
            )
        except BaseException as exc:
            if isinstance(exc, Exception):  # not a cancellation at shutdown
                self.metrics.database_error("settle")
            if not any(kept is turn for kept in self._unsettled):
                self._unsettled.append(turn)
            raise
        self._unsettled = [kept for kept in self._unsettled if kept is not turn]
        answers = self.leases.answers
        key_freed = self._key_freed
        return report_turn(
            everything, outcomes, settled, self.metrics, key_freed, answers, looked_up
        )

    def readiness(self) -> dict[str, Any]:
        """Readiness for /readyz: run() delivers (its destinations' retention checked) and the
        database answers (checked at most once a second)."""
        answered, delivering = self._database_answers() is not None, self.delivering.is_set()
        ready = {"database": answered, "delivering": delivering}
        return {"ok": answered and delivering, "owner": self.owner, **ready}

    def health(self) -> dict[str, Any]:
        """Liveness for /healthz: the loop has turned recently."""
        idle = time.monotonic() - self.metrics.last_turn
        limit = max(3 * self.poll_interval, 2 * self.lease)
        return {
            "ok": idle < limit,
            "owner": self.owner,
            "seconds_since_last_turn": round(idle, 3),
            "listening": self.listening.is_set(),
        }
