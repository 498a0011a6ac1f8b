"""The relay's database work: reap, claim, adopt and settle message leases.

Synchronous and short: the loop runs each call off its event loop, and tests
drive them directly, as they drive TaskQueue. Transient database errors are
retried in-process (outbox.db.retry); a settle whose COMMIT failed is resolved
by re-reading the rows, never by assuming.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import failpoints
from outbox.clock import Clock
from outbox.db import retry
from outbox.db.dialect import READ_ONLY, autocommit_lane, clock_value, one_statement
from outbox.drivers import driver_for
from outbox.drivers.records import FailedAttempt, KeyWalk
from relay.answers import AnswerBook
from relay.figures import Figures, figures_from
from relay.policy import NO_FAILURES, Dead, Outcome, Retry, Sent, retry_delay, target_state
from relay.records import ClaimedRow, Message, Settlement

log = logging.getLogger("outbox.relay")
SAMPLE_TRIES_EVERY = 20.0
"""Seconds between a relay's tries at the minute's backlog sample (see _sample)."""


class Leased(NamedTuple):
    """What one claim leased: messages to deliver, and messages only to resolve."""

    deliver: list[Message]
    resolve: list[Message]
    """Messages whose attempts are spent: asked about by receipt lookup, never sent."""


class RelayLeases:
    """One relay's leases on messages: which it holds, under which fence, until when."""

    def __init__(
        self,
        engine: Engine,
        *,
        owner: str,
        destinations: Collection[str],
        announce_for: float,
        lease: float,
        batch: int,
        max_attempts: int,
        backoff: float,
        backoff_cap: float,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """Leases for `owner` on `engine` (schema already checked)."""
        self._engine = engine
        self._driver = driver_for(engine)
        self.owner = owner
        self.destinations = sorted(destinations)
        self.announce_for = announce_for
        """How long an announcement holds: longer than the longest gap between claims."""
        self.lease = lease
        self.batch = batch
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self.clock = clock
        self._rng = rng or random.Random()
        self._next_reap = float("-inf")
        self._next_announce = float("-inf")
        self._next_sample = float("-inf")
        self.claim_in_doubt = False
        """A claim raised after its COMMIT may have happened: its rows are to be adopted."""
        # Per destination, the ordering key where this relay's last claim stopped walking
        # keys (PostgreSQL, see outbox.drivers.postgresql.key_walk): the next claim goes on
        # after it, so a key that sorts last is reached as soon as one that sorts first,
        # however many keys there are. Kept here, not in the database: each relay walks on
        # its own, and after a restart a walk starts from the first key again, which costs
        # nothing.
        self._keys = KeyWalk()
        self.answers = AnswerBook(clock)
        """Each destination's last answers, which every announcement carries."""
        # Claims and settles come many times a second: each stream keeps a connection
        # rather than checking one out of the pool each time (see outbox.db.lane).
        self._claims = autocommit_lane(engine, self._driver.claim_session())
        self._settles = autocommit_lane(engine)

    def close(self) -> None:
        """Let the held connections go (statements after this take pooled ones)."""
        self._claims.close()
        self._settles.close()

    def claim(self, busy: Collection[str] = (), may_adopt: bool = True) -> Leased:
        """Lease a batch, retrying transient errors: (messages to deliver, to resolve).

        After a claim whose outcome is unknown, the rows it may have leased are
        adopted, but only when `may_adopt` (no other turn of this relay is in
        flight); otherwise the doubt stays for a later claim.
        """
        return retry.quickly(lambda: self._claim(busy, may_adopt))

    def _claim(self, busy: Collection[str], may_adopt: bool) -> Leased:
        self._announce(clock_value(self.clock))
        self._sample(clock_value(self.clock))
        try:
            rows = self._claim_rows(busy, may_adopt)
        except sa.exc.DBAPIError:
            # The COMMIT may have happened: the rows it leased are adopted next time.
            self.claim_in_doubt = True
            raise
        deliver: list[Message] = []
        resolve: list[Message] = []
        for row in rows:
            spent = row.previous_attempts >= self.max_attempts
            (resolve if spent else deliver).append(Message.from_row(row))
        return Leased(deliver, resolve)

    def _claim_rows(self, busy: Collection[str], may_adopt: bool) -> list[ClaimedRow]:
        now = clock_value(self.clock)
        adopting = self.claim_in_doubt and may_adopt
        # Reap, adopt and claim are each one statement, atomic alone: on PostgreSQL they run
        # without BEGIN and COMMIT, one round trip each, on the path from a producer's commit
        # to delivery. SQLite picks, then updates: BEGIN IMMEDIATE holds the write lock.
        with one_statement(self._engine, lane=self._claims) as conn:
            self._reap_expired_leases(conn, now)
            rows: list[ClaimedRow] = []
            if adopting:
                rows = self._driver.adopt_messages(
                    conn, owner=self.owner, now=now, lease=self.lease
                )
            rows += self._driver.claim_messages(
                conn,
                owner=self.owner,
                now=now,
                lease=self.lease,
                limit=max(self.batch - len(rows), 0),
                budget=self.max_attempts,
                destinations=self.destinations,
                skip_destinations=sorted(busy),
                keys=self._keys,
            )
        if adopting:
            self.claim_in_doubt = False
        return rows

    def _announce(self, now: float | None) -> None:
        # Renewed at most every quarter lease, at a claim, and valid for `announce_for`
        # (longer than the longest gap between claims): a live relay's announcement does
        # not lapse, a dead one's does. Its own short transaction: a failure here says
        # nothing about the claim, and only the unrouted count depends on it.
        moment = time.monotonic() if now is None else now
        if moment < self._next_announce:
            return
        try:
            with self._engine.begin() as conn:
                self._driver.announce(
                    conn,
                    owner=self.owner,
                    destinations=self.destinations,
                    lease=self.announce_for,
                    now=now,
                    answers=self.answers.ages(),
                )
        except sa.exc.DBAPIError as exc:
            log.warning("relay %s: could not announce its destinations (%s)", self.owner, exc)
        # Failed or not, the next try is a quarter lease on: not one per claim.
        self._next_announce = moment + self.lease / 4

    def _sample(self, now: float | None) -> None:
        # The console's chart of the oldest undelivered age needs a sample a minute, which
        # the first relay to try a minute writes; trying three times a minute, a relay that
        # claims at least that often leaves no minute out. A try of a minute already
        # sampled is one primary-key probe, read in a transaction marked read-only (on
        # SQLite a deferred one, which takes no write lock); the one that samples reads
        # the figures a metrics scrape reads, then writes in a short transaction.
        moment = time.monotonic() if now is None else now
        if moment < self._next_sample:
            return
        self._next_sample = moment + SAMPLE_TRIES_EVERY
        try:
            reading = self._engine.connect().execution_options(**{READ_ONLY: True})
            with reading as conn, conn.begin():
                rows = self._driver.backlog_sample(conn, now, self.destinations)
            if rows:
                with self._engine.begin() as conn:
                    self._driver.record_backlog_sample(conn, rows)
        except sa.exc.DBAPIError as exc:
            log.warning("relay %s: could not sample the backlog (%s)", self.owner, exc)
        except Exception:
            # Only the console's chart needs it: delivery goes on whatever went wrong.
            log.exception("relay %s: could not sample the backlog", self.owner)

    def withdraw(self) -> None:
        """Stop announcing this relay's destinations (at a clean stop): a last announcement,
        lapsing at once, with the answers since the one before (kept, as lapsed rows are,
        for the console)."""
        with self._engine.begin() as conn:
            self._driver.announce(
                conn,
                owner=self.owner,
                destinations=self.destinations,
                lease=0.0,
                now=clock_value(self.clock),
                answers=self.answers.ages(),
            )
        self._next_announce = float("-inf")

    def _reap_expired_leases(self, conn: sa.Connection, now: float | None) -> None:
        # Leases expire on the scale of the lease, not of a turn or a poll: looking every
        # quarter lease finds an expired one soon enough and saves a statement per turn.
        moment = time.monotonic() if now is None else now
        if moment < self._next_reap:
            return
        reaped = self._driver.reap_expired_message_leases(conn, now, self.batch)
        # A full batch means more may be waiting: look again next turn.
        full = reaped >= self.batch
        self._next_reap = moment if full else moment + self.lease / 4

    def settle(
        self,
        messages: Sequence[Message],
        outcomes: Mapping[int, Outcome],
        unattempted: Collection[int] = frozenset(),
        failures: Mapping[int, Retry | Dead] = NO_FAILURES,
    ) -> set[int]:
        """Record outcomes, and the turn's `failures` (the answers of its attempts that did
        not deliver, by id) as failed attempts, retrying transient errors; returns the ids
        this relay settled.

        The others were taken over by a newer lease and are left as they are.
        """
        return retry.quickly(lambda: self._settle(messages, outcomes, unattempted, failures))

    def _settle(
        self,
        messages: Sequence[Message],
        outcomes: Mapping[int, Outcome],
        unattempted: Collection[int],
        failures: Mapping[int, Retry | Dead],
    ) -> set[int]:
        rows: list[Settlement] = []
        for message in messages:
            outcome = outcomes[message.id]
            delay = 0.0
            if isinstance(outcome, Retry):
                delay = retry_delay(
                    message.attempts, self.backoff, self.backoff_cap, outcome.after, self._rng
                )
            rows.append(
                Settlement(  # positional, in field order: keywords cost more per message
                    message.id,
                    message.fence,
                    target_state(outcome),
                    outcome.status,
                    None if isinstance(outcome, Sent) else outcome.error,
                    delay,
                    1 if message.id in unattempted else 0,
                    message.lease_until,
                )
            )
        # A turn's attempts that did not deliver: usually none (the drain's turns).
        failed = (
            [
                FailedAttempt(m.id, m.attempts, target_state(answer), answer.status, answer.error)
                for m in messages
                if (answer := failures.get(m.id)) is not None
            ]
            if failures
            else []
        )
        # One statement, atomic alone: autocommit on PostgreSQL (see one_statement).
        with one_statement(self._engine, "relay.before_sent_commit", lane=self._settles) as conn:
            now = clock_value(self.clock)
            settled = self._driver.settle(conn, self.owner, rows, now, failed)
            if settled:
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
        expected = {m.id: (m.fence, target_state(outcomes[m.id])) for m in messages}
        with self._engine.connect() as conn:
            rows = self._driver.lease_states(conn, list(expected))
        return {
            row.id
            for row in rows
            if (row.fence, row.state) == expected[row.id] and row.owner == self.owner
        }

    def figures(self) -> Figures:
        """Backlog, dead count and oldest undelivered age per destination, and the unrouted
        messages: one grouped read over undelivered and dead messages, none over history."""
        now = clock_value(self.clock)
        with self._engine.connect() as conn:
            rows = self._driver.destination_figures(conn, now)
            routed = self._driver.live_destinations(conn, now)
        return figures_from(rows, routed, self.destinations)
