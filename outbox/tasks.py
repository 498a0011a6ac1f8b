"""TaskQueue: intake, leases with fencing, and the terminal result written with its reply.

Every transaction here is short and never spans the work itself: claim
commits before the handler runs, finish opens a new transaction. Each state
change is a guarded UPDATE (state, owner, fence, lease, deadline); when it
touches no row the caller has lost the task and gets Fenced.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from outbox import failpoints, task_results
from outbox.backoff import backoff_delay
from outbox.claim import Claim, claims_from_rows
from outbox.clock import Clock
from outbox.db.caller import caller_connection
from outbox.db.dialect import READ_ONLY, autocommit_lane, clock_value, one_statement
from outbox.db.handle import DatabaseHandle
from outbox.db.lane import Lane
from outbox.drivers.task_interface import Held
from outbox.errors import BatchFailed, Fenced, OutboxError
from outbox.intake import Ack, AuthContext, Envelope, accept, authorize, check_name
from outbox.messages import (
    ReplyError,
    TaskReply,
    add_task_replies,
    check_destination,
    message_dict,
)
from outbox.states import ErrorCode, TaskState
from outbox.task_cancel import cancel_in, storable_reason
from outbox.task_intake import store_accepted
from outbox.task_reconcile import reconcile_in
from outbox.trace_context import active_context

RECONCILE_BATCH = 100


def _held(claim: Claim) -> Held:
    """The (task_id, owner, fence) naming `claim` in a guarded statement."""
    return (claim.task_id, claim.owner, claim.fence)


class TaskQueue(DatabaseHandle):
    """Durable intake, fenced task leases, and results committed with their replies."""

    # Not at start: a service that only receives tasks claims nothing, whatever the server.
    # The first claim or reconcile checks the server once (a Worker asks when it is made).
    _claims_rows = False

    _lanes: tuple[Lane, ...] = ()  # none yet while the schema is checked

    def __init__(
        self,
        url_or_engine: str | sa.URL | Engine,
        clock: Clock | None = None,
        allowed_sources: Iterable[str] = (),
        lease: float = 10,
        backoff: float = 2,
        backoff_cap: float = 300,
        max_hops: int = 4,
        reply_destination: str = "default",
        tenant_cap: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """Open a queue on a database already upgraded with `outbox db upgrade`."""
        if isinstance(allowed_sources, str):
            raise TypeError("allowed_sources must be a collection of principals, not one string")
        for name, value in (("lease", lease), ("backoff", backoff), ("backoff_cap", backoff_cap)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if backoff_cap < backoff:
            raise ValueError("backoff_cap must be >= backoff")
        if isinstance(max_hops, bool) or not isinstance(max_hops, int) or max_hops < 1:
            raise ValueError(f"max_hops must be an int >= 1, got {max_hops!r}")
        if tenant_cap is not None and (
            isinstance(tenant_cap, bool) or not isinstance(tenant_cap, int) or tenant_cap < 1
        ):
            raise ValueError(f"tenant_cap must be None or an int >= 1, got {tenant_cap!r}")
        self.reply_destination = check_destination(reply_destination)
        self.allowed_sources = frozenset(check_name("allowed source", s) for s in allowed_sources)
        self.lease = float(lease)
        self.backoff = float(backoff)
        self.backoff_cap = float(backoff_cap)
        self.max_hops = max_hops
        self.tenant_cap = tenant_cap
        self.clock = clock
        self._rng = rng or random.Random()
        self._open(url_or_engine)
        # A worker claims and finishes many times a second: each stream of statements
        # keeps a connection rather than checking one out (and pinging it) each time.
        self._claims = autocommit_lane(self._engine, self._driver.task_claim_session())
        self._finishes = autocommit_lane(self._engine)
        self._lanes = (self._claims, self._finishes)

    def close(self) -> None:
        """Give back the held connections, then release the pool when this queue created it."""
        for lane in self._lanes:
            lane.close()
        super().close()

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        with self._engine.connect().execution_options(**{READ_ONLY: True}) as conn, conn.begin():
            yield conn

    # --- intake -------------------------------------------------------------------

    def receive(self, auth: AuthContext, envelope: Envelope) -> Ack:
        """Store an envelope durably and return its ACK only after commit."""
        authorize(auth, envelope, self.allowed_sources)
        accepted = accept(auth, envelope)
        with self._engine.begin() as conn:
            ack = store_accepted(conn, accepted, self.clock, self.max_hops, self.reply_destination)
            if not ack.duplicate:  # a duplicate wrote nothing
                failpoints.hit("intake.before_commit")
        failpoints.hit("intake.after_commit")
        return ack

    def receive_tx(
        self, session: Session | Connection, auth: AuthContext, envelope: Envelope
    ) -> Ack:
        """Store an envelope in the caller's transaction (never commits); the rules of receive().

        The task exists once the caller commits, together with the caller's own writes,
        and the Ack holds from that commit on; a rollback leaves nothing. The session
        must be on this queue's database.
        """
        conn = caller_connection(
            session,
            "TaskQueue.receive_tx",
            "await outbox.asyncio.receive_tx(queue, session, auth, envelope)",
        )
        authorize(auth, envelope, self.allowed_sources)
        accepted = accept(auth, envelope)
        return store_accepted(conn, accepted, self.clock, self.max_hops, self.reply_destination)

    def receive_batch(self, auth: AuthContext, envelopes: Sequence[Envelope]) -> list[Ack]:
        """Receive item by item; on failure raise BatchFailed with the ACKs already committed."""
        acks: list[Ack] = []
        for index, envelope in enumerate(envelopes):
            try:
                acks.append(self.receive(auth, envelope))
            except Exception as exc:
                raise BatchFailed(index, acks, exc) from exc
        return acks

    # --- leases ---------------------------------------------------------------------

    def claim(self, owner: str) -> Claim | None:
        """Lease the best claimable task to `owner`, or return None when there is none."""
        claims = self.claim_many(owner, 1)
        return claims[0] if claims else None

    def claim_many(self, owner: str, limit: int, *, reconcile: bool = True) -> list[Claim]:
        """Lease up to `limit` claimable tasks to `owner` in one short transaction.

        The transaction reconciles first (see reconcile()) unless `reconcile` is
        False: a caller that claims many times a second, like Worker, reconciles
        on its own cadence instead.
        """
        check_name("owner", owner)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        self.check_claims()
        now = clock_value(self.clock)
        with one_statement(
            self._engine,
            "claim.before_commit",
            single=self.claim_is_one_statement(reconcile),
            lane=self._claims,
        ) as conn:
            self._driver.task_claim_transaction_setting(conn)
            if reconcile:
                reconcile_in(conn, now, self.reply_destination, RECONCILE_BATCH)
            rows = self._driver.claim_tasks(
                conn,
                owner=owner,
                now=now,
                lease=self.lease,
                limit=limit,
                tenant_cap=self.tenant_cap,
            )
            if rows:
                failpoints.hit("claim.before_commit")
        failpoints.hit("claim.after_commit")
        return claims_from_rows(rows)

    def claim_is_one_statement(self, reconcile: bool) -> bool:
        """Whether a claim is one statement: it neither reconciles nor counts a tenant cap."""
        return not reconcile and self.tenant_cap is None

    def renew(self, claim: Claim) -> Claim:
        """Extend the lease (heartbeat); Fenced when the task is no longer held by this claim."""
        renewed = self.renew_many([claim])[0]
        if isinstance(renewed, Fenced):
            raise renewed
        return renewed

    def renew_many(self, claims: Sequence[Claim]) -> list[Claim | Fenced]:
        """Extend many leases in one statement: per claim, the Claim with its lease_until,
        or the Fenced error saying why the task is no longer held by it.

        A task whose row is locked by a write under way (its finish, say) is not waited
        for: while it is still held, its Claim comes back with the lease unchanged. A
        database error raises.
        """
        now = clock_value(self.clock)
        held = [(claim.task_id, claim.owner, claim.fence) for claim in claims]
        answers: list[Claim | Fenced] = []
        with one_statement(self._engine) as conn:
            renewed = self._driver.renew_leases(conn, held, self.lease, now)
            for claim, key in zip(claims, held, strict=True):
                until = renewed.get(key)
                if until is None:
                    # Not renewed: lost, or skipped while its row was locked. Ask again.
                    until = self._driver.held_lease(conn, key, now)
                if until is None:
                    answers.append(task_results.fenced(conn, claim))
                else:
                    answers.append(dataclasses.replace(claim, lease_until=until))
        return answers

    def finish(
        self, claim: Claim, result: Any, effect: Callable[[Session], None] | None = None
    ) -> None:
        """Commit `done`, the result and its reply in one transaction, with optional own writes."""
        with self._engine.begin() as conn:
            self.finish_in(conn, claim, result)
            if effect is not None:
                with Session(bind=conn) as session:
                    effect(session)
                    session.flush()
            failpoints.hit("finish.before_commit")
        failpoints.hit("finish.after_commit")

    def finish_tx(self, session: Session | Connection, claim: Claim, result: Any) -> None:
        """Write `done`, the result and its reply in the caller's transaction; never commits."""
        conn = caller_connection(
            session,
            "TaskQueue.finish_tx",
            "await outbox.asyncio.finish_tx(queue, session, claim, result)",
        )
        self.finish_in(conn, claim, result)

    def finish_in(self, conn: Connection, claim: Claim, result: Any) -> None:
        """Write `done`, the result and its reply on an open connection; never commits."""
        (refused,) = task_results.complete(
            conn, [(claim, result)], self.reply_destination, clock_value(self.clock)
        )
        if refused is not None:
            raise refused

    def finish_many(
        self,
        finished: Sequence[tuple[Claim, Any]],
        contexts: task_results.ReplyContexts | None = None,
    ) -> list[OutboxError | None]:
        """Commit many (claim, result) pairs, each result with its reply, in one transaction.

        Returns, per pair, None when it was committed, or the InvalidMessage or
        Fenced that kept it out; the others commit regardless. A database error
        raises and commits none. A reply's creation context is its task's in
        `contexts` (the run's span), else the active span's.
        """
        # PostgreSQL writes one result in one statement (see one_statement); a batch may
        # take a second statement for the rows the first left (a heartbeat's renewal
        # meanwhile), so it is one transaction: either commits with the other.
        single = len(finished) == 1
        with one_statement(
            self._engine, "finish.before_commit", single=single, lane=self._finishes
        ) as conn:
            refused = task_results.complete(
                conn, finished, self.reply_destination, clock_value(self.clock), contexts
            )
            if None in refused:
                failpoints.hit("finish.before_commit")
        failpoints.hit("finish.after_commit")
        return refused

    def fail(
        self,
        claim: Claim,
        reason: str,
        permanent: bool = False,
        context: Mapping[str, str] | None = None,
    ) -> str:
        """Record a failed attempt: back to pending after backoff, or `failed` with its reply
        (whose creation context is `context`, the run's span, else the active span's)."""
        reason = storable_reason(reason)
        delay = backoff_delay(claim.attempt, self.backoff, self.backoff_cap, self._rng)
        with self._engine.begin() as conn:
            now = clock_value(self.clock)
            state = self._driver.fail_task(
                conn, _held(claim), now, reason=reason, permanent=bool(permanent), delay=delay
            )
            if state is None:
                raise task_results.fenced(conn, claim)
            if state == TaskState.FAILED:
                code = ErrorCode.PERMANENT_FAILURE if permanent else ErrorCode.ATTEMPTS_EXHAUSTED
                add_task_replies(
                    conn,
                    [
                        TaskReply(
                            claim.task_id,
                            state,
                            error=ReplyError(code, reason),
                            creation=active_context() if context is None else context,
                        )
                    ],
                    self.reply_destination,
                    now,
                )
        return str(state)

    def release(self, claim: Claim) -> bool:
        """Give a claimed task back before its handler ran: pending at once, the attempt not
        counted. False when the claim no longer holds it (nothing changed)."""
        with self._engine.begin() as conn:
            return self._driver.release_task(conn, _held(claim), clock_value(self.clock))

    def cancel(self, task_id: str, reason: str = "cancelled") -> bool:
        """Cancel a pending or running task with its reply; False when it is already final."""
        with self._engine.begin() as conn:
            return cancel_in(
                conn,
                self._driver,
                task_id,
                storable_reason(reason),
                self.reply_destination,
                clock_value(self.clock),
            )

    def check_claims(self) -> None:
        """ConfigError when the server or the engine makes claims unsafe (checked once)."""
        self._check_server()

    def reconcile(self) -> dict[str, int]:
        """Expire tasks past their deadline and reclaim expired task and delivery leases."""
        self.check_claims()
        totals = {"expired": 0, "requeued": 0, "failed": 0, "messages_requeued": 0}
        while True:
            with self._engine.begin() as conn:
                now = clock_value(self.clock)
                counts = reconcile_in(conn, now, self.reply_destination, RECONCILE_BATCH)
                counts["messages_requeued"] = self._driver.reap_expired_message_leases(
                    conn, now, RECONCILE_BATCH
                )
            for key, value in counts.items():
                totals[key] += value
            if max(counts.values()) < RECONCILE_BATCH:
                return totals

    # --- reading ------------------------------------------------------------------

    def task(self, task_id: str) -> dict[str, Any] | None:
        """One task as a dict (payload and result decoded), or None."""
        with self._reading() as conn:
            row = self._driver.task_row(conn, task_id)
        if row is None:
            return None
        task = dict(row)
        task["payload"] = json.loads(task["payload"])
        task["result"] = None if task["result"] is None else json.loads(task["result"])
        return task

    def messages(self, state: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Outbox messages in sequence order, optionally of one state."""
        with self._reading() as conn:
            rows = self._driver.messages_in_order(conn, state, limit)
        return [message_dict(row) for row in rows]
