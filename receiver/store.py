"""ReceiptStore: dedupe by reply_id plus the hash of the exact body, effect committed once.

``accept`` runs one transaction: insert the receipt unless its reply_id is
already stored (an insert that ignores conflicts, with RETURNING to tell a
fresh row from an existing one), then either run the effect (fresh) or compare
content hashes (existing: same hash is a duplicate, another is a
PayloadCollision). Concurrent identical requests therefore serialize on the
primary key: on PostgreSQL the losers' ``ON CONFLICT DO NOTHING`` waits for the
winner to commit and then reads its row; on SQLite ``BEGIN IMMEDIATE`` admits
one writer at a time.

``accept_many`` stores a batch the same way in one transaction. With
``isolate=True`` an effect that raises fails only its own item: the batch is
stored again item by item, each under a SAVEPOINT, in the batch's order; the
failed item answers ``retry``, and the later items of its ordering key answer
``held`` (not applied), so a key's messages are applied in order or not at all.
A batch that succeeds takes the bulk path alone, with no savepoints. An item named
in ``last_tries`` (a broker consumer's message on its last allowed delivery) whose
effect raises is not retried: it is written to ``receiver_dead_letters`` in the same
transaction and answers ``dead``, and the later items of its key go on.

Errors (outbox.errors): PayloadCollision (same reply_id, other body; nothing
changed), StoreUnavailable (the database cannot be reached or kept failing
transiently: try again later), SchemaNotReady (the receiver tables are missing
or too old).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import failpoints
from outbox.canonical import sha256_hex
from outbox.clock import Clock
from outbox.db import retry
from outbox.db.dialect import READ_ONLY, clock_value, one_statement
from outbox.db.handle import DatabaseHandle
from outbox.durations import duration_text
from outbox.errors import PayloadCollision
from outbox.messages import are_reply_ids, check_ordering_key, check_reply_id
from outbox.migrations import RECEIVER_BRANCH
from receiver.batch_result import BatchResult, item_status
from receiver.dead_letters import LastTry
from receiver.effects import Effect, record_effect, run_effects
from receiver.isolated import accept_one_by_one
from receiver.unavailable import LostRace, lost_race, unavailable, unavailable_when_it_fails

DEFAULT_RETENTION = 30 * 86_400.0
PURGE_BATCH = 1000
# Tries of one transaction: a dropped connection, a serialization failure or a race with
# purge is resolved by a second try; a third failure means the database is not well.
_TRIES = 3

T = TypeVar("T")

BatchItem: TypeAlias = tuple[str, bytes] | tuple[str, bytes, str | None]
"""One message of a batch: (reply_id, body), or (reply_id, body, ordering_key or None)."""


@dataclass(frozen=True)
class Receipt:
    """A stored receipt; `duplicate` says it was already stored before this call."""

    reply_id: str
    content_hash: str
    received_at: float
    duplicate: bool


_BODY_TYPES = (bytes, bytearray, memoryview)
"""What a body may be: a tuple, built once, where `bytes | ...` would build a union per item."""


def _check_item(item: object, checked_id: bool) -> None:
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise TypeError("an item is (reply_id, body) or (reply_id, body, ordering_key)")
    if not checked_id:
        check_reply_id(item[0])
    if not isinstance(item[1], _BODY_TYPES):
        raise TypeError(f"body must be bytes, not {type(item[1]).__name__}")
    if len(item) == 3:
        check_ordering_key(item[2])


class Statuses(list[str]):
    """accept_many's answer: one status per item, in order; `errors` gives, by item index,
    a short reason for each `retry` or `dead` (an exception's class name, never its text)."""

    def __init__(self, statuses: Iterable[str] = (), errors: dict[int, str] | None = None) -> None:
        """The statuses, and the reasons of the `retry` and `dead` ones."""
        super().__init__(statuses)
        self.errors: dict[int, str] = errors or {}


class ReceiptStore(DatabaseHandle):
    """Receipts deduplicated by reply_id and body hash; the effect commits with the receipt."""

    def __init__(
        self,
        url_or_engine: str | sa.URL | Engine,
        *,
        clock: Clock | None = None,
        retention: float = DEFAULT_RETENTION,
    ) -> None:
        """Open a store on a database upgraded with `receiver.upgrade` (SchemaNotReady if not)."""
        if isinstance(retention, bool) or not isinstance(retention, int | float) or retention <= 0:
            raise ValueError(f"retention must be a positive number of seconds, got {retention!r}")
        self.clock = clock
        self.retention = float(retention)
        # No ping per checkout (a round trip per request): a connection found dropped
        # fails its statement, and accept and the reads retry on a fresh one.
        self._open(url_or_engine, RECEIVER_BRANCH, pool_pre_ping=False)

    def _worth_another_try(self, exc: BaseException) -> bool:
        """A lost race, or a transient error; not SQLite busy, whose timeout already waited."""
        if lost_race(exc):
            return True
        return retry.is_transient(exc) and not retry.waited_for_lock(exc)

    def _check_schema(self, branch: str) -> None:
        with unavailable_when_it_fails():
            super()._check_schema(branch)

    def accept(self, reply_id: str, body: bytes, effect: Effect | None = None) -> Receipt:
        """Store a receipt and run `effect` once per reply_id (None: no effect); same id,
        other body: PayloadCollision."""
        outcomes = self._accept_all([(reply_id, body)], effect)
        [status], [digest] = outcomes.statuses, outcomes.digests
        if status == "conflict":
            stored_hash, _ = outcomes.held[reply_id]
            raise PayloadCollision(
                f"reply_id {reply_id!r} is stored with content hash {stored_hash}; "
                f"this body hashes to {digest}"
            )
        received_at = (
            outcomes.inserted[reply_id] if status == "stored" else outcomes.held[reply_id][1]
        )
        return Receipt(reply_id, digest, received_at, duplicate=status == "duplicate")

    def accept_many(
        self,
        items: Sequence[BatchItem],
        effect: Effect | None = None,
        *,
        isolate: bool = False,
        last_tries: Mapping[int, LastTry] | None = None,
    ) -> Statuses:
        """Store many receipts in ONE transaction, deduped per item: stored|duplicate|conflict.

        An item is (reply_id, body) or (reply_id, body, ordering_key). An effect that
        raises rolls the whole batch back and the exception propagates, unless
        `isolate`: then the batch is stored item by item in one transaction, the
        failed item is `retry` (its reason in the result's `errors`), the later
        items of its ordering key are `held` (not applied), and the rest are stored.
        An item whose index is in `last_tries` (isolate only) is `dead` instead of
        `retry`: kept in receiver_dead_letters, and its key's later items go on.
        """
        if last_tries and not isolate:
            raise ValueError("last_tries needs isolate=True")
        outcomes = self._accept_all(items, effect, isolate, last_tries or {})
        return Statuses(outcomes.statuses, outcomes.errors)

    def _accept_all(
        self,
        items: Sequence[BatchItem],
        effect: Effect | None,
        isolate: bool = False,
        last_tries: Mapping[int, LastTry] | None = None,
    ) -> BatchResult:
        reply_ids = [item[0] for item in items]
        # One pass for the usual batch; a bad one is then found and named.
        checked_ids = are_reply_ids(reply_ids)
        for item in items:
            _check_item(item, checked_ids)
        bodies = [bytes(item[1]) for item in items]
        run = effect
        # On PostgreSQL the reference effect is written by the receipt insert itself. That
        # one statement is then the whole transaction, as it is with no effect at all: it
        # runs in autocommit (see one_statement for where "before commit" is then).
        fused = run is record_effect and self._driver.fuses_reference_effect
        single = fused or run is None

        def store() -> BatchResult:
            with one_statement(self._engine, "receiver.before_commit", single=single) as conn:
                outcomes = self._accept_in(conn, reply_ids, bodies, run, fused)
                if outcomes.inserted:
                    failpoints.hit("receiver.before_commit")
                return outcomes

        def store_one_by_one(run: Effect) -> BatchResult:
            keys = [item[2] if len(item) == 3 else None for item in items]
            with one_statement(self._engine, "receiver.before_commit", single=False) as conn:
                now = clock_value(self.clock)
                outcomes = accept_one_by_one(
                    self._driver, conn, now, (reply_ids, bodies, keys), run, last_tries or {}
                )
                if outcomes.inserted:
                    failpoints.hit("receiver.before_commit")
                return outcomes

        with unavailable_when_it_fails():
            try:
                # A second try after a COMMIT that failed is safe: the receipt makes it a
                # duplicate.
                outcomes = retry.quickly(store, retry_if=self._worth_another_try, tries=_TRIES)
            except Exception as exc:
                # Only an effect can fail one item and not the others; a database that
                # cannot work now fails them all, as without `isolate`.
                if not isolate or run is None or unavailable(exc) is not None:
                    raise
                outcomes = retry.quickly(
                    functools.partial(store_one_by_one, run),
                    retry_if=self._worth_another_try,
                    tries=_TRIES,
                )
        failpoints.hit("receiver.after_commit")
        return outcomes

    def _accept_in(
        self,
        conn: sa.Connection,
        reply_ids: list[str],
        bodies: list[bytes],
        effect: Effect | None,
        fused: bool,
    ) -> BatchResult:
        """Insert receipts in bulk; run the effect on each first receipt (`fused`: the insert's)."""
        digests = [sha256_hex(body) for body in bodies]
        first: dict[str, int] = {}
        for index, reply_id in enumerate(reply_ids):
            first.setdefault(reply_id, index)
        distinct = len(first) == len(reply_ids)
        indexes = first.values()
        inserted = self._driver.insert_receipts(
            conn,
            reply_ids if distinct else [reply_ids[i] for i in indexes],
            digests if distinct else [digests[i] for i in indexes],
            bodies if distinct else [bodies[i] for i in indexes],
            clock_value(self.clock),
            with_reference_effect=fused,
        )
        missing = [reply_id for reply_id in first if reply_id not in inserted]
        held = (
            {
                stored.reply_id: (stored.content_hash, stored.received_at)
                for stored in self._driver.held_receipts(conn, missing)
            }
            if missing
            else {}
        )
        if len(held) < len(missing):
            raise LostRace  # purged between our insert and our read
        if distinct and not held:
            # The usual batch: every reply is new.
            statuses = ["stored"] * len(reply_ids)
        else:
            statuses = [
                item_status(index, first[reply_id], digests, held.get(reply_id))
                for index, reply_id in enumerate(reply_ids)
            ]
        if effect is not None and inserted and not fused:
            fresh = [
                (reply_id, inserted[reply_id], bodies[index])
                for reply_id, index in first.items()
                if reply_id in inserted
            ]
            run_effects(conn, effect, fresh)
        return BatchResult(statuses, digests, inserted, held, {})

    def lookup(self, reply_id: str) -> Receipt | None:
        """The stored receipt of `reply_id` (duplicate=True: it predates this call), or None."""
        stored = self._read(lambda conn: self._driver.receipt(conn, reply_id))
        if stored is None:
            return None
        return Receipt(reply_id, stored.content_hash, stored.received_at, duplicate=True)

    def body(self, reply_id: str) -> bytes | None:
        """The exact body stored for `reply_id`, or None."""
        return self._read(lambda conn: self._driver.receipt_body(conn, reply_id))

    def dead_among(self, reply_ids: Sequence[str]) -> set[str]:
        """Which of `reply_ids` are in the dead letters."""
        if not reply_ids:
            return set()
        return self._read(lambda conn: self._driver.dead_among(conn, reply_ids))

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """The oldest `limit` dead letters, without their bodies: reply_id, reason, failures,
        deliveries, broker, dead_at."""
        return self._read(lambda conn: self._driver.dead_letters(conn, limit))

    def dead_letter(self, reply_id: str) -> dict[str, Any] | None:
        """One dead letter, body and headers included (headers as a dict), or None."""
        row = self._read(lambda conn: self._driver.dead_letter(conn, reply_id))
        if row is None:
            return None
        letter = dict(row)
        letter["body"] = bytes(letter["body"])
        letter["headers"] = json.loads(letter["headers"])
        return letter

    def retry_dead(self, reply_id: str, effect: Effect | None) -> str | None:
        """Apply a dead letter's body through `effect` as a first receipt, and forget it: the
        dedupe status (stored, duplicate: applied meanwhile; conflict: kept), or None when
        there is no such dead letter. An effect that raises leaves it dead and propagates."""

        def store() -> str | None:
            with self._engine.begin() as conn:
                row = self._driver.dead_letter(conn, reply_id)
                if row is None:
                    return None
                outcomes = self._accept_in(conn, [reply_id], [bytes(row["body"])], effect, False)
                [status] = outcomes.statuses
                if status != "conflict":
                    self._driver.delete_dead_letter(conn, reply_id)
                return status

        with unavailable_when_it_fails():
            return retry.quickly(store, retry_if=self._worth_another_try, tries=_TRIES)

    def purge_dead(self, reply_id: str | None = None, *, older_than: float | None = None) -> int:
        """Forget one dead letter (`reply_id`), or those dead for over `older_than` seconds."""
        if (reply_id is None) == (older_than is None):
            raise ValueError("give a reply_id or older_than, not both")
        with unavailable_when_it_fails(), self._engine.begin() as conn:
            if reply_id is not None:
                return self._driver.delete_dead_letter(conn, reply_id)
            assert older_than is not None
            now = clock_value(self.clock)
            return self._driver.delete_dead_letters_before(conn, now, older_than)

    def _read(self, read: Callable[[sa.Connection], T]) -> T:
        """What `read` returns on a read-only connection; a connection found dropped is
        replaced."""

        def attempt() -> T:
            with self._engine.connect().execution_options(**{READ_ONLY: True}) as conn:
                return read(conn)

        with unavailable_when_it_fails():
            return retry.quickly(attempt, retry_if=self._worth_another_try, tries=_TRIES)

    def purge(self, older_than: float, *, batch: int = PURGE_BATCH) -> int:
        """Delete receipts older than `older_than` seconds (never under the retention); count."""
        if older_than < self.retention:
            raise ValueError(
                f"refusing to purge receipts younger than the published retention "
                f"({duration_text(self.retention)}): a relay may still resend them; lower the "
                "retention "
                f"explicitly first"
            )
        if batch < 1:
            raise ValueError("batch must be >= 1")
        removed = 0
        while True:
            with unavailable_when_it_fails(), self._engine.begin() as conn:
                now = clock_value(self.clock)
                count = self._driver.purge_receipts(conn, now, older_than, batch)
            removed += count
            if count < batch:
                return removed
