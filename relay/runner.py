"""The relay loop: claim -> deliver (bounded concurrency) -> settle, until told to stop.

Database work is short synchronous transactions run off the event loop;
HTTP runs on pooled keep-alive async clients, one per destination. Claim and
settle retry transient database errors in-process; a settle whose COMMIT
failed is resolved by re-reading the rows, never by assuming.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import signal
import socket
import sqlite3
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from tenacity import Retrying as TenacityRetrying
from tenacity import (
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from outbox import _sql as outbox_sql
from outbox import failpoints
from outbox._handle import DatabaseHandle
from outbox.clock import Clock, now_expression
from relay import _sql
from relay.config import ConfigError, Destination, check_destinations
from relay.delivery import Message, pack_batches, post_batch, post_one, receipt_matches
from relay.http import HttpClient, TransportError
from relay.metrics import MetricsServer, RelayMetrics
from relay.policy import (
    Dead,
    Outcome,
    Retry,
    Sent,
    Unsent,
    longest_retry_window,
    retry_delay,
    truncate,
)
from relay.wakeup import Wakeups

log = logging.getLogger("outbox.relay")
T = TypeVar("T")
Verdict = Literal["sent", "retry", "dead"]
RETENTION_HEADER = "outbox-receipt-retention"
LEASE_MARGIN = 0.5  # seconds: the last attempt of a turn must end this long before the lease
PIPELINE = 2  # turns delivering at once: one POSTs while the next claims


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (a dependency off Windows): HTTP costs less CPU on it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def is_transient(exc: BaseException) -> bool:
    """Database errors worth retrying: lost connections, serialization failures, SQLite busy."""
    if isinstance(exc, sa.exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = exc.orig
        sqlstate = getattr(orig, "sqlstate", None)
        if sqlstate is not None:
            # 40001 serialization failure, 40P01 deadlock, 08xxx connection, 57P0x shutdown.
            return sqlstate in ("40001", "40P01") or sqlstate.startswith(("08", "57P"))
        if isinstance(orig, sqlite3.OperationalError):
            code = getattr(orig, "sqlite_errorcode", None)
            return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
        return isinstance(exc, sa.exc.OperationalError)
    return False


class Relay(DatabaseHandle):
    """A fenced relay: leases outbox messages and delivers them over HTTP with backoff."""

    def __init__(
        self,
        url_or_engine: str | sa.URL | Engine,
        destinations: Mapping[str, Destination],
        owner: str | None = None,
        clock: Clock | None = None,
        lease: float = 30,
        backoff: float = 2,
        attempts: int = 3,
        batch: int = 100,
        concurrency: int = 32,
        backoff_cap: float = 300,
        poll_interval: float = 1.0,
        grace: float | None = None,
        rng: random.Random | None = None,
        metrics_port: int | None = None,
    ) -> None:
        """Validate the configuration and open the database (schema must be current)."""
        self.destinations = check_destinations(destinations)
        longest = max(d.timeout for d in self.destinations.values())
        if not lease > longest:
            raise ConfigError(
                f"lease ({lease:g}s) must be longer than the longest attempt timeout "
                f"({longest:g}s), or a slow attempt would outlive its lease"
            )
        for name, value in (("attempts", attempts), ("batch", batch), ("concurrency", concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if not (backoff > 0 and backoff_cap >= backoff and poll_interval > 0):
            raise ConfigError("backoff, backoff_cap and poll_interval must be positive")
        if owner is None:
            # Unique per instance: relays sharing an owner name could not tell their
            # leases apart.
            owner = f"relay-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"[-200:]
        if not isinstance(owner, str) or not 1 <= len(owner) <= 200 or "\x00" in owner:
            raise ConfigError("owner must be a str of 1..200 characters without NUL")
        self.owner = owner
        self.clock = clock
        self.lease = float(lease)
        self.backoff = float(backoff)
        self.backoff_cap = float(backoff_cap)
        self.attempts = attempts
        self.batch = batch
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.grace = self.lease if grace is None else grace
        self._rng = rng or random.Random()
        # No ping per checkout: a dropped connection fails a statement, which the claim and
        # settle retries handle on a fresh one; a ping would cost a round trip per turn.
        self._open(url_or_engine, pool_pre_ping=False)
        self._next_reap = float("-inf")
        self._autocommit = self._engine.execution_options(isolation_level="AUTOCOMMIT")
        self._loop = _new_event_loop()
        self._clients: dict[str, HttpClient] = {}
        self._limits: dict[str, asyncio.Semaphore] = {}
        self._stopping: asyncio.Event | None = None
        self._claim_in_doubt = False
        # Turns whose settle failed: their outcomes are known and recorded before the next
        # claim, never sent again.
        self._unsettled: list[Turn] = []
        self.listening = threading.Event()
        """Set while a LISTEN connection is up (PostgreSQL), so NOTIFY wakes the loop."""
        self.metrics = RelayMetrics(self._backlog)
        self._metrics_port = metrics_port
        self.metrics_server: MetricsServer | None = None

    # --- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Close HTTP clients and, when the relay created it, the connection pool."""
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            for client in self._clients.values():
                loop.run_until_complete(client.close())
            self._clients.clear()
            # A settle abandoned at shutdown may still run in a worker thread: let it end
            # before the engine goes away under it.
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
        super().close()

    def dispatch_once(self) -> list[tuple[str, Verdict]]:
        """Claim one batch, deliver it, settle it; returns (reply_id, verdict) per message."""
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
        self._stopping = asyncio.Event()
        if self._metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics, self._metrics_port, self.health)
            self.metrics_server.start()
        if install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self._stopping.set)
        await self.check_retention()
        wakeups = self._wakeups()
        listener = None if wakeups is None else asyncio.ensure_future(wakeups.keep_listening())
        log.info("relay %s started", self.owner)
        stop = asyncio.ensure_future(self._stopping.wait())
        # A claimed batch is split by destination, and each part is delivered and settled
        # on its own, so a destination that hangs holds up only its own replies. The next
        # claim does not wait for the previous POST: behind a backlog (the last claim was
        # full) it starts at once, otherwise at the next NOTIFY or poll. A destination
        # with PIPELINE parts posting is left out of claims, so what arrives while both
        # are out goes in one later part, not many tiny ones, and a hung destination
        # cannot stop the others' claims. Claims skip keys with a message in flight, so
        # per-key order holds.
        flying: set[asyncio.Future[None]] = set()  # parts delivering or settling
        pipelines: dict[str, Pipeline] = defaultdict(Pipeline)
        backlog = False
        try:
            while not self._stopping.is_set():
                flying = {f for f in flying if not f.done()}
                busy = {name for name in self.destinations if pipelines[name].full()}
                if busy == set(self.destinations):
                    waits: set[asyncio.Future[Any]] = {*flying, stop}
                    for pipeline in pipelines.values():
                        waits |= pipeline.posting
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    continue
                if wakeups is not None:
                    # Cleared before claiming: a NOTIFY that lands mid-claim wakes the next turn.
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
                await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            await self._land(flying)
            stop.cancel()
            if listener is not None:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
            if install_signal_handlers:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(signum)
            if self.metrics_server is not None:
                self.metrics_server.close()
            log.info("relay %s stopped", self.owner)

    def _wakeups(self) -> Wakeups | None:
        """NOTIFY wake-ups on PostgreSQL; SQLite has none and polls."""
        if self._dialect != "postgresql":
            return None
        url = self._engine.url.set(drivername="postgresql")
        conninfo = url.render_as_string(hide_password=False)
        return Wakeups(conninfo, self.poll_interval, self.listening)

    async def check_retention(self) -> None:
        """Refuse to run when a destination keeps receipts shorter than our retry window."""
        for name, destination in self.destinations.items():
            window = longest_retry_window(
                self.attempts, self.backoff, self.backoff_cap, destination.timeout, self.lease
            )
            health = destination.url.rstrip("/").rsplit("/", 1)[0] + "/healthz"
            try:
                response = await self._client(name).request(
                    "GET", health, headers={}, seconds=destination.timeout
                )
            except (TimeoutError, TransportError) as exc:
                # Unreachable now is a delivery problem, retried like any other; but say
                # that the retention could not be checked.
                log.warning("destination %s: receipt retention not checked (%s)", name, exc)
                continue
            advertised = response.headers.get(RETENTION_HEADER)
            if advertised is None:
                continue
            try:
                retention = float(advertised)
            except ValueError:
                continue
            if retention < window:
                raise ConfigError(
                    f"destination {name!r} keeps receipts for {retention:g}s, shorter than the "
                    f"longest retry window ({window:g}s): a late resend could apply twice"
                )

    async def _dispatch(self) -> list[tuple[str, Verdict]]:
        await self._record_unsettled()
        claimed = await self._claim_batch()
        if claimed is None:
            return []
        return await self._record(await self._deliver_batch(*claimed))

    async def _claim_next(
        self, flying: set[asyncio.Future[None]], busy: set[str]
    ) -> Claimed | None:
        """run()'s claim, without `busy` destinations; adopt only with nothing in flight."""
        if self._claim_in_doubt and flying:
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
            turn = await self._deliver_batch(*claimed)
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
        deliver, resolve = await asyncio.to_thread(
            self._retrying, lambda: self._claim(busy, may_adopt)
        )
        if not deliver and not resolve:
            return None
        failpoints.hit("relay.after_claim")
        # The lease runs from the claim: an attempt that could not finish before it ends is
        # not started, or another relay might send the same message at the same time.
        return deliver, resolve, started + self.lease - LEASE_MARGIN

    async def _deliver_batch(
        self, deliver: list[Message], resolve: list[Message], deadline: float
    ) -> Turn:
        """Deliver one claimed batch and resolve what may not be sent; returns what to settle."""
        outcomes = await self._deliver(deliver, deadline)
        # Only a delivery that never started gives its attempt back; a later lookup that
        # ran out of lease time does not (the attempt was made).
        unattempted = {i for i, outcome in outcomes.items() if isinstance(outcome, Unsent)}
        outcomes.update(await self._resolve(resolve, "lease expired while sending", deadline))
        spent = [
            m for m in deliver if isinstance(outcomes[m.id], Retry) and m.attempts >= self.attempts
        ]
        if spent:
            outcomes.update(
                await self._resolve(spent, "retry budget exhausted", deadline, outcomes)
            )
        failpoints.hit("relay.after_remote_commit")
        return deliver + resolve, outcomes, unattempted

    async def _record(self, turn: Turn) -> list[tuple[str, Verdict]]:
        everything, outcomes, unattempted = turn
        try:
            settled = await asyncio.to_thread(
                self._retrying, lambda: self._settle(everything, outcomes, unattempted)
            )
        except BaseException:
            if not any(kept is turn for kept in self._unsettled):
                self._unsettled.append(turn)
            raise
        self._unsettled = [kept for kept in self._unsettled if kept is not turn]
        verdicts: list[tuple[str, Verdict]] = []
        # Counted per kind, not per message: a batch is mostly one kind.
        kinds: Counter[tuple[str, Verdict, int | None]] = Counter()
        for message in everything:
            if message.id not in settled:
                log.warning("reply %s was taken over; not settled here", message.reply_id)
                continue
            outcome = outcomes[message.id]
            verdict = _verdict(outcome)
            kinds[message.destination, verdict, outcome.status] += 1
            if not isinstance(outcome, Sent):
                log.info(
                    "reply %s %s: %s",
                    message.reply_id,
                    verdict,
                    outcome.error,
                    extra={"fields": {"reply_id": message.reply_id, "outcome": verdict}},
                )
            verdicts.append((message.reply_id, verdict))
        for (destination, verdict, status), count in kinds.items():
            self.metrics.record(destination, verdict, status, count)
        return verdicts

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

    def _backlog(self) -> tuple[int, float | None]:
        with self._engine.connect() as conn:
            count, age = conn.execute(_sql.backlog(self._now())).one()
        return int(count), None if age is None else float(age)

    async def _deliver(self, messages: Sequence[Message], deadline: float) -> dict[int, Outcome]:
        outcomes: dict[int, Outcome] = {}
        by_destination: dict[str, list[Message]] = defaultdict(list)
        for message in messages:
            if message.destination in self.destinations:
                by_destination[message.destination].append(message)
            else:
                outcomes[message.id] = Dead(
                    None, f"unknown destination {message.destination!r}: not in relay configuration"
                )
        jobs: list[Awaitable[dict[int, Outcome]]] = []
        for name, group in by_destination.items():
            destination = self.destinations[name]
            client = self._client(name)
            if destination.mode == "batch":
                packed = pack_batches(
                    group, destination.max_batch_items, destination.max_batch_bytes
                )
                jobs.extend(
                    self._limited(
                        name,
                        chunk,
                        partial(post_batch, client, destination, chunk, body),
                        deadline,
                    )
                    for chunk, body in packed
                )
            else:
                jobs.extend(
                    self._limited(
                        name,
                        [message],
                        partial(self._one, client, destination, message),
                        deadline,
                    )
                    for message in group
                )
        for result in await asyncio.gather(*jobs):
            outcomes.update(result)
        return outcomes

    async def _one(
        self, client: HttpClient, destination: Destination, message: Message
    ) -> dict[int, Outcome]:
        return {message.id: await post_one(client, destination, message)}

    async def _limited(
        self,
        name: str,
        messages: Sequence[Message],
        attempt: Callable[[], Awaitable[dict[int, Outcome]]],
        deadline: float,
    ) -> dict[int, Outcome]:
        """Run one request under the destination's concurrency limit, if the lease allows it."""
        destination = self.destinations[name]
        self._client(name)  # creates the destination's limit with its client
        async with self._limits[name]:
            if time.monotonic() + destination.timeout > deadline:
                return dict.fromkeys((m.id for m in messages), Unsent())
            started = time.monotonic()
            try:
                return await attempt()
            finally:
                elapsed = time.monotonic() - started
                self.metrics.latency.labels(name, destination.mode).observe(elapsed)

    async def _resolve(
        self,
        messages: Sequence[Message],
        why: str,
        deadline: float,
        last: Mapping[int, Outcome] | None = None,
    ) -> dict[int, Outcome]:
        """Settle messages that may not be sent again: a matching receipt means sent, else dead."""

        async def lookup(message: Message, destination: Destination) -> dict[int, Outcome]:
            client = self._client(message.destination)
            found = await receipt_matches(
                client, destination, message.reply_id, message.content_hash
            )
            return {message.id: Sent(None)} if found else {}

        jobs: list[Awaitable[dict[int, Outcome]]] = []
        for message in messages:
            destination = self.destinations.get(message.destination)
            if destination is not None and destination.receipt_lookup:
                jobs.append(
                    self._limited(
                        message.destination,
                        [message],
                        partial(lookup, message, destination),
                        deadline,
                    )
                )
        # A lookup answers Sent, nothing (no matching receipt), or Unsent (no lease time left).
        answered: dict[int, Outcome] = {}
        for result in await asyncio.gather(*jobs):
            answered.update(result)
        outcomes: dict[int, Outcome] = {}
        for message in messages:
            if message.id in answered:
                outcomes[message.id] = answered[message.id]
                continue
            previous = last.get(message.id) if last else None
            tail = f"; last: {previous.error}" if isinstance(previous, Retry | Dead) else ""
            status = previous.status if isinstance(previous, Retry | Dead) else None
            outcomes[message.id] = Dead(status, truncate(f"outcome unknown: {why}{tail}"))
        return outcomes

    def _client(self, name: str) -> HttpClient:
        client = self._clients.get(name)
        if client is None:
            destination = self.destinations[name]
            client = HttpClient(destination.concurrency)
            self._clients[name] = client
            self._limits[name] = asyncio.Semaphore(min(destination.concurrency, self.concurrency))
        return client

    # --- database ------------------------------------------------------------------

    def _retrying(self, operation: Callable[[], T]) -> T:
        for attempt in TenacityRetrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(6),
            wait=wait_exponential_jitter(multiplier=0.05, max=2.0, jitter=0.05),
            reraise=True,
        ):
            with attempt:
                return operation()
        raise AssertionError("unreachable")  # pragma: no cover

    def _now(self) -> sa.ColumnElement[float]:
        return now_expression(self.clock, self._dialect)

    def _claim(
        self, busy: Collection[str] = (), may_adopt: bool = True
    ) -> tuple[list[Message], list[Message]]:
        """Lease a batch: (messages to deliver, messages whose attempts are spent to resolve).

        After a claim whose outcome is unknown, the rows it may have leased are adopted,
        but only when `may_adopt` (no other turn of this relay is in flight); otherwise
        the doubt stays for a later claim.
        """
        try:
            rows = self._claim_rows(busy, may_adopt)
        except sa.exc.DBAPIError:
            # The COMMIT may have happened: the rows it leased are adopted next time.
            self._claim_in_doubt = True
            raise
        deliver: list[Message] = []
        resolve: list[Message] = []
        for row in rows:
            (resolve if row[-1] >= self.attempts else deliver).append(_message(row))
        return deliver, resolve

    def _claim_rows(self, busy: Collection[str], may_adopt: bool = True) -> list[tuple[Any, ...]]:
        now = None if self.clock is None else float(self.clock())
        adopting = self._claim_in_doubt and may_adopt
        with self._claim_connection() as conn:
            self._reap_expired_leases(conn, now)
            rows: list[tuple[Any, ...]] = []
            if adopting:
                rows = _sql.adopt_messages(conn, owner=self.owner, now=now, lease=self.lease)
            rows += _sql.claim_messages(
                conn,
                owner=self.owner,
                now=now,
                lease=self.lease,
                limit=max(self.batch - len(rows), 0),
                budget=self.attempts,
                skip_destinations=sorted(busy),
            )
        if adopting:
            self._claim_in_doubt = False
        return rows

    def _claim_connection(self) -> Any:
        if self._dialect == "postgresql":
            # Reap, adopt and claim are each one statement, atomic alone: without BEGIN and
            # COMMIT the claim costs one round trip instead of three, on the path from a
            # producer's commit to delivery.
            return self._autocommit.connect()
        # SQLite picks, then updates: BEGIN IMMEDIATE holds the write lock between them.
        return self._engine.begin()

    def _reap_expired_leases(self, conn: sa.Connection, now: float | None) -> None:
        # Leases expire on the scale of the lease, not of a turn or a poll: looking every
        # quarter lease finds an expired one soon enough and saves a statement per turn.
        moment = time.monotonic() if now is None else now
        if moment < self._next_reap:
            return
        reaped = conn.execute(
            outbox_sql.reap_expired_message_leases(self._dialect),
            {"now": now, "limit": self.batch},
        ).all()
        # A full batch means more may be waiting: look again next turn.
        full = len(reaped) >= self.batch
        self._next_reap = moment if full else moment + self.lease / 4

    def _settle(
        self,
        messages: Sequence[Message],
        outcomes: Mapping[int, Outcome],
        unattempted: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> set[int]:
        """Record outcomes; returns the ids this relay settled (others were taken over)."""
        rows: list[_sql.Settlement] = []
        for message in messages:
            outcome = outcomes[message.id]
            delay = 0.0
            if isinstance(outcome, Retry):
                delay = retry_delay(
                    message.attempts, self.backoff, self.backoff_cap, outcome.after, self._rng
                )
            error = None if isinstance(outcome, Sent) else outcome.error
            rows.append(
                (
                    message.id,
                    message.fence,
                    _TARGET_STATE[type(outcome)],
                    outcome.status,
                    error,
                    delay,
                    1 if message.id in unattempted else 0,
                )
            )
        now = None if self.clock is None else float(self.clock())
        with self._engine.begin() as conn:
            settled = _sql.settle(conn, self.owner, rows, now)
            failpoints.hit("relay.before_sent_commit")
        failpoints.hit("relay.after_sent_commit")
        missing = [m for m in messages if m.id not in settled]
        if missing:
            # A retried settle finds rows an earlier, failed-looking COMMIT did settle:
            # read what the database holds instead of assuming either way.
            settled |= self._already_settled(missing, outcomes)
        return settled

    def _already_settled(
        self, messages: Sequence[Message], outcomes: Mapping[int, Outcome]
    ) -> set[int]:
        expected = {m.id: (m.fence, _TARGET_STATE[type(outcomes[m.id])]) for m in messages}
        with self._engine.connect() as conn:
            rows = conn.execute(_sql.select_states(list(expected))).all()
        return {
            row.id
            for row in rows
            if (row.fence, row.state) == expected[row.id] and row.owner == self.owner
        }


Turn = tuple[list[Message], dict[int, Outcome], set[int]]
"""A delivered turn to settle: its messages, their outcomes, the ids never attempted."""
Claimed = tuple[list[Message], list[Message], float]
"""A claimed batch: messages to deliver, messages to resolve, the monotonic deadline."""


def by_destination(claimed: Claimed) -> list[tuple[str, Claimed]]:
    """Split a claimed batch into one part per destination, each with the batch's deadline."""
    deliver, resolve, deadline = claimed
    parts: dict[str, tuple[list[Message], list[Message]]] = defaultdict(lambda: ([], []))
    for message in deliver:
        parts[message.destination][0].append(message)
    for message in resolve:
        parts[message.destination][1].append(message)
    return [(name, (d, r, deadline)) for name, (d, r) in parts.items()]


class Pipeline:
    """One destination's parts in run(): posting until delivered, unfinished until settled."""

    def __init__(self) -> None:
        """Nothing in flight."""
        self.posting: set[asyncio.Future[None]] = set()
        self.unfinished: set[asyncio.Future[None]] = set()

    def add(self, delivered: asyncio.Future[None], turn: asyncio.Future[None]) -> None:
        """Track a part: `delivered` resolves after its POSTs, `turn` after its settle."""
        self.posting.add(delivered)
        self.unfinished.add(turn)

    def full(self) -> bool:
        """PIPELINE parts posting, or more than PIPELINE not yet settled: claim none now."""
        self.posting = {f for f in self.posting if not f.done()}
        self.unfinished = {f for f in self.unfinished if not f.done()}
        # A settle never holds up the next claim (they touch different rows), but at most
        # PIPELINE + 1 parts per destination are unfinished at once.
        return len(self.posting) >= PIPELINE or len(self.unfinished) > PIPELINE


_TARGET_STATE: dict[type, str] = {Sent: "sent", Retry: "pending", Unsent: "pending", Dead: "dead"}


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


def _message(row: tuple[Any, ...]) -> Message:
    ident, reply_id, destination, body, content_hash, headers, attempts, fence, _ = row
    return Message(
        id=ident,
        reply_id=reply_id,
        destination=destination,
        body=bytes(body),
        content_hash=content_hash,
        # Most messages have no headers: skip decoding the same "{}" for every row.
        headers=_NO_HEADERS if headers == "{}" else json.loads(headers),
        attempts=attempts,
        fence=fence,
    )


def _verdict(outcome: Outcome) -> Verdict:
    if isinstance(outcome, Sent):
        return "sent"
    if isinstance(outcome, Retry | Unsent):
        return "retry"
    return "dead"
