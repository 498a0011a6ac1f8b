"""Operating a running outbox: counts per state, dead messages, decisions, purges.

The queries behind `outbox status`, `outbox dead` and `outbox purge` are the
driver's (outbox.drivers). Ages are measured against the database's clock
(or a manual clock in tests), never the operator's. Requeue and resolve are
explicit, audited decisions about a dead message: a requeue sends the same
reply_id and body again; a resolve says it needs no delivery, for good. Each
writes a row of `outbox_requeues` (who, when, why, what the destination's
receipt lookup said) in the transaction that changes the message.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox.clock import Clock
from outbox.db.dialect import clock_value
from outbox.db.handle import DatabaseHandle
from outbox.dead_filter import DeadFilter
from outbox.drivers.base import DeadOutcome, StateTable
from outbox.errors import RequeueRefused, ResolveRefused, TaskNotCancelled
from outbox.schema import MESSAGE_STATES, TASK_STATES
from outbox.states import DeadDecision, MessageState, TaskDecision
from outbox.task_cancel import cancel_in, storable_reason

PURGE_BATCH = 1000
PURGED_STATES = (MessageState.SENT.value, MessageState.RESOLVED.value)
"""The states `purge` deletes once old enough: nothing is left to do for them."""
ALL_DEAD = DeadFilter()
RECEIPT_ANSWERS = ("received", "other body", "not received", "unknown", "not checked")


class Operations(DatabaseHandle):
    """Status, dead messages, decisions about them, and purges on one outbox database."""

    _shared: sa.Connection | None = None
    """The transaction decisions share, in Operations made by together()."""

    def __init__(self, url_or_engine: str | sa.URL | Engine, clock: Clock | None = None) -> None:
        """Open the database (its schema must be current)."""
        self.clock = clock
        self._open(url_or_engine)

    @contextmanager
    def together(self) -> Iterator[Operations]:
        """Operations whose decisions (requeue, resolve) share one transaction, committed
        when the block ends, or rolled back, all of them, when it raises: a bulk decision's
        batch, which would otherwise wait for a commit per message."""
        with self._engine.begin() as conn:
            shared = copy.copy(self)
            shared._shared = conn
            shared._owns_engine = False  # closing it must not dispose of this one's pool
            yield shared

    @contextmanager
    def _decision(self) -> Iterator[sa.Connection]:
        """The transaction a decision runs in: the shared one, or one of its own."""
        if self._shared is not None:
            yield self._shared
            return
        with self._engine.begin() as conn:
            yield conn

    def _now(self) -> float | None:
        return clock_value(self.clock)

    def status(self, estimate_over: int | None = None) -> dict[str, Any]:
        """Counts per state of tasks and messages, the oldest pending of each, the dead count,
        and the pending messages no running relay delivers (unrouted).

        With `estimate_over`, a table whose statistics put it over that many rows has its
        final states estimated from them (their names in "estimated", a key only then):
        counting them would read the whole history. Live states are always counted.
        """
        with self._engine.connect() as conn:
            task_counts, tasks_estimated = self._counts(conn, "tasks", TASK_STATES, estimate_over)
            message_counts, messages_estimated = self._counts(
                conn, "messages", MESSAGE_STATES, estimate_over
            )
            oldest_task = self._oldest_age(conn, "tasks")
            oldest_message = self._oldest_age(conn, "messages")
            unrouted, unrouted_age = self.driver.unrouted(conn, self._now())
        status: dict[str, Any] = {
            "tasks": task_counts,
            "messages": message_counts,
            "oldest_pending_task_age": oldest_task,
            "oldest_pending_message_age": oldest_message,
            "dead": message_counts["dead"],
            "unrouted": unrouted,
            "oldest_unrouted_age": None if unrouted_age is None else round(unrouted_age, 3),
        }
        if estimate_over is not None:
            status["estimated"] = {"tasks": tasks_estimated, "messages": messages_estimated}
        return status

    def _counts(
        self,
        conn: sa.Connection,
        table: StateTable,
        states: tuple[str, ...],
        estimate_over: int | None,
    ) -> tuple[dict[str, int], list[str]]:
        """Rows per state, every known state listed (zero when absent), and the states whose
        figure is an estimate."""
        estimates = None if estimate_over is None else self.driver.state_estimates(conn, table)
        if estimates is None or sum(estimates.values()) <= (estimate_over or 0):
            found = self.driver.state_counts(conn, table)
            return {name: found.get(name, 0) for name in states}, []
        live = self.driver.live_state_counts(conn, table)
        counts = {name: live.get(name, estimates.get(name, 0)) for name in states}
        return counts, [name for name in states if name not in live]

    def _oldest_age(self, conn: sa.Connection, table: StateTable) -> float | None:
        """Seconds since the oldest pending row of `table` was created, or None."""
        age = self.driver.oldest_pending_age(conn, table, self._now())
        return None if age is None else round(age, 3)

    def dead(self, limit: int = 100, chosen: DeadFilter = ALL_DEAD) -> list[dict[str, Any]]:
        """Dead messages that match `chosen`, oldest first: why each died, after how many
        attempts, and how long ago it was created (`age`, seconds)."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self._engine.connect() as conn:
            return self.driver.dead_messages(conn, limit, self._now(), chosen)

    def message(self, reply_id: str) -> dict[str, Any] | None:
        """One message's delivery record (state, attempts, last status and error, body), or
        None."""
        with self._engine.connect() as conn:
            return self.driver.delivery_record(conn, reply_id)

    def requeue(
        self, reply_id: str, *, reason: str, by: str, receipt: str, forced: bool
    ) -> dict[str, Any]:
        """Make a dead message pending again with a fresh budget, and record why; the audit row.

        `receipt` is what the destination's lookup said (one of RECEIPT_ANSWERS);
        the caller decides beforehand whether that allows a requeue. RequeueRefused when
        the message is not dead.
        """
        [done] = self.requeue_many([(reply_id, receipt, forced)], reason=reason, by=by)
        if isinstance(done, str):
            raise RequeueRefused(done)
        return done

    def requeue_many(
        self, chosen: Sequence[tuple[str, str, bool]], *, reason: str, by: str
    ) -> list[dict[str, Any] | str]:
        """Requeue dead messages, each (reply_id, receipt, forced), in one transaction: for
        each, its audit row, or why nothing was requeued (it was not dead)."""
        for _, receipt, _ in chosen:
            if receipt not in RECEIPT_ANSWERS:
                raise ValueError(f"receipt must be one of {RECEIPT_ANSWERS}, got {receipt!r}")
        return self._decide(DeadDecision.REQUEUE, chosen, reason, by)

    def resolve(self, reply_id: str, *, reason: str, by: str) -> dict[str, Any]:
        """Settle a dead message as needing no delivery (final), and record why; the audit row.

        Nothing is asked of the destination: the operator vouches that the
        message needs no delivery (say, the destination confirmed it some other way).
        ResolveRefused when the message is not dead.
        """
        [done] = self.resolve_many([reply_id], reason=reason, by=by)
        if isinstance(done, str):
            raise ResolveRefused(done)
        return done

    def resolve_many(
        self, reply_ids: Sequence[str], *, reason: str, by: str
    ) -> list[dict[str, Any] | str]:
        """Resolve dead messages in one transaction: for each, its audit row, or why nothing
        was resolved (it was not dead)."""
        chosen = [(reply_id, "not checked", False) for reply_id in reply_ids]
        return self._decide(DeadDecision.RESOLVE, chosen, reason, by)

    def _decide(
        self,
        action: DeadDecision,
        chosen: Sequence[tuple[str, str, bool]],
        reason: str,
        by: str,
    ) -> list[dict[str, Any] | str]:
        """Take one decision about each of the `chosen` (reply_id, receipt, forced) in one
        transaction, a statement for them all: their rows locked, changed, and audited."""
        check_decision(reason, by)
        consequence = "nothing requeued" if action is DeadDecision.REQUEUE else "nothing resolved"
        with self._decision() as conn:
            locked = self.driver.lock_dead(conn, [reply_id for reply_id, _, _ in chosen])
            decided: list[tuple[int, dict[str, Any], int]] = []
            for index, (reply_id, receipt, forced) in enumerate(chosen):
                # pop: a reply_id given twice is decided once; the second finds it not dead.
                if (dead := locked.pop(reply_id, None)) is not None:
                    values = audit_values(action, dead, reply_id, by, reason, receipt, forced)
                    decided.append((index, values, dead.id))
            ids = [message_id for _, _, message_id in decided]
            if action is DeadDecision.REQUEUE:
                changed = self.driver.requeue_dead(conn, ids, self._now())
            else:
                changed = self.driver.resolve_dead(conn, ids, self._now())
            if changed != len(ids):
                # The rows are locked: a mismatch is a driver's fault, so nothing is kept.
                raise RuntimeError(f"{len(ids)} dead messages locked, {changed} changed")
            audits = self.driver.insert_decision_audits(
                conn, [values for _, values, _ in decided], self._now()
            )
            done: dict[int, dict[str, Any]] = {
                index: audit for (index, _, _), audit in zip(decided, audits, strict=True)
            }
            return [
                done[index] if index in done else self._not_dead(conn, reply_id, consequence)
                for index, (reply_id, _, _) in enumerate(chosen)
            ]

    def cancel_task(
        self, task_id: str, *, reason: str, by: str, reply_destination: str = "default"
    ) -> dict[str, Any]:
        """Cancel a pending or running task, its reply written to `reply_destination` as a
        worker's would be, and record who and why; the audit row.

        TaskNotCancelled when there is no such task or it is already final.
        """
        check_decision(reason, by)
        reason = storable_reason(reason)
        with self._decision() as conn:
            now = self._now()
            if not cancel_in(conn, self.driver, task_id, reason, reply_destination, now):
                row = self.driver.task_row(conn, task_id)
                raise TaskNotCancelled(task_id, None if row is None else str(row["state"]))
            values = {
                "task_id": task_id,
                "action": TaskDecision.CANCEL.value,
                "requested_by": by,
                "reason": reason,
            }
            return self.driver.insert_task_decision(conn, values, now)

    def _not_dead(self, conn: sa.Connection, reply_id: str, consequence: str) -> str:
        """Why a decision about `reply_id` found no dead message to change."""
        state = self.driver.message_state(conn, reply_id)
        if state is None:
            return f"no message {reply_id!r}; {consequence}"
        if state == MessageState.RESOLVED:
            return f"message {reply_id!r} is resolved, which is final; {consequence}"
        return f"message {reply_id!r} is {state}, not dead; {consequence}"

    def purge(
        self,
        older_than: float,
        batch: int = PURGE_BATCH,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, int]:
        """Delete messages sent, or resolved, more than `older_than` seconds ago, `batch` rows
        per transaction; how many of each state were deleted.

        `progress` is told the running total after each batch. Short transactions
        keep the relays and writers moving meanwhile.
        """
        if not older_than >= 0:
            raise ValueError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        removed = dict.fromkeys(PURGED_STATES, 0)
        while True:
            with self._engine.begin() as conn:
                chosen = self.driver.purge_messages(conn, self._now(), older_than, batch)
            for state in chosen:
                removed[state] += 1
            if progress is not None and chosen:
                progress(sum(removed.values()))
            if len(chosen) < batch:
                return removed


def audit_values(
    action: DeadDecision,
    previous: DeadOutcome,
    reply_id: str,
    by: str,
    reason: str,
    receipt: str,
    forced: bool,
) -> dict[str, Any]:
    """The audit row of one decision on a dead message (`previous` its last outcome)."""
    return {
        "action": action.value,
        "reply_id": reply_id,
        "requested_by": by,
        "reason": reason,
        "receipt": receipt,
        "forced": forced,
        "previous_attempts": previous.attempts,
        "previous_status": previous.last_status,
        "previous_error": previous.last_error,
    }


def check_decision(reason: str, by: str) -> None:
    """A decision names who takes it and why: both are kept in the audit."""
    if not reason.strip():
        raise ValueError("a reason is required: it is kept in the audit table")
    if not by.strip():
        raise ValueError("who decides must be named")
