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
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import failpoints
from outbox.canonical import sha256_hex
from outbox.clock import Clock
from outbox.db import retry
from outbox.db.dialect import READ_ONLY, is_postgresql, now_expression, one_statement
from outbox.db.handle import DatabaseHandle
from outbox.durations import duration_text
from outbox.errors import PayloadCollision
from outbox.messages import are_reply_ids, check_ordering_key, check_reply_id
from outbox.migrations import RECEIVER_BRANCH
from outbox.one_line import one_line
from outbox.redaction import redact
from receiver import sql
from receiver.effects import Effect, record_effect, run_effects
from receiver.errors import StoreUnavailable
from receiver.schema import receipts

DEFAULT_RETENTION = 30 * 86_400.0
PURGE_BATCH = 1000
# Tries of one transaction: a dropped connection, a serialization failure or a race with
# purge is resolved by a second try; a third failure means the database is not well.
_TRIES = 3
REASON_CHARS = 500
"""A dead letter's reason keeps this much of the exception's (redacted) text."""

BatchItem: TypeAlias = tuple[str, bytes] | tuple[str, bytes, str | None]
"""One message of a batch: (reply_id, body), or (reply_id, body, ordering_key or None)."""

log = logging.getLogger("outbox.receiver.store")


class _LostRace(Exception):
    """The transaction lost a race (with purge, or another writer) it can win on a second try."""


def _lost_race(exc: BaseException) -> bool:
    """A race a second try wins: a purge between insert and read, or a concurrent insert of
    the same reply_id under a stricter isolation level (a unique violation on receipts)."""
    if isinstance(exc, _LostRace):
        return True
    orig = getattr(exc, "orig", None)
    diag = getattr(orig, "diag", None)
    return getattr(orig, "sqlstate", None) == "23505" and (
        getattr(diag, "table_name", None) == receipts.name
    )


def _unavailable(exc: BaseException) -> str | None:
    """Why `exc` means the store cannot work now (a later try may pass), or None: it does not."""
    if isinstance(exc, sa.exc.TimeoutError):  # pool exhausted: the same advice as a busy server
        return f"no database connection available: {exc}"
    if _lost_race(exc):
        return "kept losing races to store receipts; try again"
    if isinstance(exc, sa.exc.DBAPIError):
        # Cannot talk to the database, rather than a bad statement: a later try may pass.
        unreachable = isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError)
        if unreachable or retry.is_transient(exc):
            return f"receipt database unavailable: {exc.orig}"
    return None


@contextmanager
def _unavailable_when_it_fails() -> Iterator[None]:
    """Say StoreUnavailable for what a later try may pass: pool exhausted, transient errors."""
    try:
        yield
    except Exception as exc:
        reason = _unavailable(exc)
        if reason is None:
            raise
        raise StoreUnavailable(reason) from exc


@dataclass(frozen=True)
class Receipt:
    """A stored receipt; `duplicate` says it was already stored before this call."""

    reply_id: str
    content_hash: str
    received_at: float
    duplicate: bool


def _check_item(item: object, checked_id: bool) -> None:
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise TypeError("an item is (reply_id, body) or (reply_id, body, ordering_key)")
    if not checked_id:
        check_reply_id(item[0])
    if not isinstance(item[1], bytes | bytearray | memoryview):
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


@dataclass(frozen=True)
class LastTry:
    """What to keep of a message on its last allowed delivery, should its effect raise now."""

    headers: Mapping[str, str]
    """Headers worth keeping (a consumer leaves the signature out)."""
    failures: int
    """Deliveries whose effect raised, this one included."""
    deliveries: int | None = None
    """The broker's own count of deliveries, when it gives one."""
    broker: str | None = None
    """nats or rabbitmq."""
    broker_ref: str | None = None
    """Where the broker kept it: stream and sequence, or queue."""


def dead_reason(exc: BaseException) -> str:
    """A dead letter's reason: the exception's class and the start of its redacted text."""
    text = one_line(redact(str(exc)), REASON_CHARS)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Decided(NamedTuple):
    """What one transaction decided: a status per item, and what accept() reports from it."""

    statuses: list[str]
    digests: list[str]
    inserted: dict[str, float]
    """received_at of each receipt this transaction stored."""
    held: dict[str, tuple[str, float]]
    """content hash and received_at of each receipt that was stored before it."""
    errors: dict[int, str]
    """Why each `retry` item failed, by index (isolated batches only)."""


def _status(
    index: int,
    first: int,
    digests: Sequence[str],
    held: tuple[str, float] | None,
) -> str:
    """stored, duplicate or conflict for item `index`, whose reply_id first came at `first`."""
    if held is None and index == first:
        return "stored"
    stored_hash = digests[first] if held is None else held[0]
    return "duplicate" if stored_hash == digests[index] else "conflict"


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
        if _lost_race(exc):
            return True
        return retry.is_transient(exc) and not (
            not is_postgresql(self._dialect) and retry.waited_for_lock(exc)
        )

    def _check_schema(self, branch: str) -> None:
        with _unavailable_when_it_fails():
            super()._check_schema(branch)

    def accept(self, reply_id: str, body: bytes, effect: Effect | None = None) -> Receipt:
        """Store a receipt and run `effect` once per reply_id (None: no effect); same id,
        other body: PayloadCollision."""
        decided = self._accept_all([(reply_id, body)], effect)
        [status], [digest] = decided.statuses, decided.digests
        if status == "conflict":
            stored_hash, _ = decided.held[reply_id]
            raise PayloadCollision(
                f"reply_id {reply_id!r} is stored with content hash {stored_hash}; "
                f"this body hashes to {digest}"
            )
        received_at = (
            decided.inserted[reply_id] if status == "stored" else decided.held[reply_id][1]
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
        decided = self._accept_all(items, effect, isolate, last_tries or {})
        return Statuses(decided.statuses, decided.errors)

    def _accept_all(
        self,
        items: Sequence[BatchItem],
        effect: Effect | None,
        isolate: bool = False,
        last_tries: Mapping[int, LastTry] | None = None,
    ) -> _Decided:
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
        fused = run is record_effect and is_postgresql(self._dialect)
        single = fused or run is None

        def store() -> _Decided:
            with one_statement(self._engine, "receiver.before_commit", single=single) as conn:
                decided = self._accept_in(conn, reply_ids, bodies, run, fused)
                if decided.inserted:
                    failpoints.hit("receiver.before_commit")
                return decided

        def store_one_by_one(run: Effect) -> _Decided:
            keys = [item[2] if len(item) == 3 else None for item in items]
            with one_statement(self._engine, "receiver.before_commit", single=False) as conn:
                decided = self._accept_one_by_one(
                    conn, reply_ids, bodies, keys, run, last_tries or {}
                )
                if decided.inserted:
                    failpoints.hit("receiver.before_commit")
                return decided

        with _unavailable_when_it_fails():
            try:
                # A second try after a COMMIT that failed is safe: the receipt makes it a
                # duplicate.
                decided = retry.quickly(store, retry_if=self._worth_another_try, tries=_TRIES)
            except Exception as exc:
                # Only an effect can fail one item and not the others; a database that
                # cannot work now fails them all, as without `isolate`.
                if not isolate or run is None or _unavailable(exc) is not None:
                    raise
                decided = retry.quickly(
                    functools.partial(store_one_by_one, run),
                    retry_if=self._worth_another_try,
                    tries=_TRIES,
                )
        failpoints.hit("receiver.after_commit")
        return decided

    def _accept_one_by_one(
        self,
        conn: sa.Connection,
        reply_ids: list[str],
        bodies: list[bytes],
        keys: list[str | None],
        effect: Effect,
        last_tries: Mapping[int, LastTry],
    ) -> _Decided:
        """Each item under its own SAVEPOINT, in order: an effect that raises rolls back its
        item alone (`retry`) and holds the later items of its ordering key (`held`); on an
        item's last try it goes to the dead letters instead (`dead`), holding nothing."""
        digests = [sha256_hex(body) for body in bodies]
        statuses: list[str] = []
        inserted: dict[str, float] = {}
        held: dict[str, tuple[str, float]] = {}
        errors: dict[int, str] = {}
        blocked: set[str] = set()
        for index, (reply_id, body, key) in enumerate(zip(reply_ids, bodies, keys, strict=True)):
            if key is not None and key in blocked:
                statuses.append("held")
                continue
            savepoint = conn.begin_nested()
            # The receipt's own statement failing is the store's failure: it fails the batch.
            fresh = sql.insert_receipts(conn, [reply_id], [digests[index]], [body], self.clock)
            if reply_id not in fresh:
                savepoint.commit()
                row = conn.execute(sql.select_held([reply_id])).first()
                if row is None:
                    raise _LostRace  # purged between our insert and our read
                if reply_id not in inserted:
                    held[reply_id] = (row.content_hash, float(row.received_at))
                statuses.append("duplicate" if row.content_hash == digests[index] else "conflict")
                continue
            try:
                run_effects(conn, effect, [(reply_id, fresh[reply_id], body)])
            except Exception as exc:
                if _unavailable(exc) is not None:
                    raise  # the database, not this item: the whole batch is retried
                savepoint.rollback()
                reason = f"effect raised {type(exc).__name__}"
                last = last_tries.get(index)
                if last is not None:
                    self._bury(conn, reply_id, digests[index], body, last, exc)
                    errors[index] = reason
                    statuses.append("dead")
                    continue  # its key is not blocked: a dead message holds nothing back
                log.error(
                    "the effect of reply_id %s raised; its receipt is rolled back and it is "
                    "to be sent again%s",
                    reply_id,
                    "" if key is None else ", with the later messages of its ordering key",
                    exc_info=True,
                    extra={"fields": {"reply_id": reply_id, "reason": reason}},
                )
                errors[index] = reason
                statuses.append("retry")
                if key is not None:
                    blocked.add(key)
                continue
            savepoint.commit()
            inserted[reply_id] = fresh[reply_id]
            statuses.append("stored")
        return _Decided(statuses, digests, inserted, held, errors)

    def _bury(
        self,
        conn: sa.Connection,
        reply_id: str,
        content_hash: str,
        body: bytes,
        last: LastTry,
        exc: BaseException,
    ) -> None:
        """Write a message whose effect raised on its last try to the dead letters; log it."""
        reason = dead_reason(exc)
        row = {
            "reply_id": reply_id,
            "content_hash": content_hash,
            "body": body,
            "headers": json.dumps(dict(sorted(last.headers.items())), ensure_ascii=False),
            "reason": reason,
            "failures": last.failures,
            "deliveries": last.deliveries,
            "broker": last.broker,
            "broker_ref": last.broker_ref,
        }
        sql.insert_dead_letter(conn, row, self.clock)
        log.error(
            "the effect of reply_id %s raised on its last allowed delivery (%d failures): it "
            "is kept in receiver_dead_letters and acknowledged, and the later messages of its "
            "ordering key go on",
            reply_id,
            last.failures,
            exc_info=True,
            extra={"fields": {"reply_id": reply_id, "reason": reason, "failures": last.failures}},
        )

    def _accept_in(
        self,
        conn: sa.Connection,
        reply_ids: list[str],
        bodies: list[bytes],
        effect: Effect | None,
        fused: bool,
    ) -> _Decided:
        """Insert receipts in bulk; run the effect on each first receipt (`fused`: the insert's)."""
        digests = [sha256_hex(body) for body in bodies]
        first: dict[str, int] = {}
        for index, reply_id in enumerate(reply_ids):
            first.setdefault(reply_id, index)
        distinct = len(first) == len(reply_ids)
        indexes = first.values()
        inserted = sql.insert_receipts(
            conn,
            reply_ids if distinct else [reply_ids[i] for i in indexes],
            digests if distinct else [digests[i] for i in indexes],
            bodies if distinct else [bodies[i] for i in indexes],
            self.clock,
            with_reference_effect=fused,
        )
        missing = [reply_id for reply_id in first if reply_id not in inserted]
        held = (
            {
                row.reply_id: (row.content_hash, float(row.received_at))
                for row in conn.execute(sql.select_held(missing))
            }
            if missing
            else {}
        )
        if len(held) < len(missing):
            raise _LostRace  # purged between our insert and our read
        if distinct and not held:
            # The usual batch: every reply is new.
            statuses = ["stored"] * len(reply_ids)
        else:
            statuses = [
                _status(index, first[reply_id], digests, held.get(reply_id))
                for index, reply_id in enumerate(reply_ids)
            ]
        if effect is not None and inserted and not fused:
            fresh = [
                (reply_id, inserted[reply_id], bodies[index])
                for reply_id, index in first.items()
                if reply_id in inserted
            ]
            run_effects(conn, effect, fresh)
        return _Decided(statuses, digests, inserted, held, {})

    def lookup(self, reply_id: str) -> Receipt | None:
        """The stored receipt of `reply_id` (duplicate=True: it predates this call), or None."""
        row = self._read_one(sql.select_receipt(reply_id))
        if row is None:
            return None
        return Receipt(reply_id, row.content_hash, float(row.received_at), duplicate=True)

    def body(self, reply_id: str) -> bytes | None:
        """The exact body stored for `reply_id`, or None."""
        row = self._read_one(sql.select_body(reply_id))
        return None if row is None else bytes(row.body)

    def dead_among(self, reply_ids: Sequence[str]) -> set[str]:
        """Which of `reply_ids` are in the dead letters."""
        if not reply_ids:
            return set()
        return {row.reply_id for row in self._read_all(sql.select_dead_among(reply_ids))}

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """The oldest `limit` dead letters, without their bodies: reply_id, reason, failures,
        deliveries, broker, dead_at."""
        return [dict(row._mapping) for row in self._read_all(sql.select_dead_letters(limit))]

    def dead_letter(self, reply_id: str) -> dict[str, Any] | None:
        """One dead letter, body and headers included (headers as a dict), or None."""
        row = self._read_one(sql.select_dead_letter(reply_id))
        if row is None:
            return None
        letter = dict(row._mapping)
        letter["body"] = bytes(letter["body"])
        letter["headers"] = json.loads(letter["headers"])
        return letter

    def retry_dead(self, reply_id: str, effect: Effect | None) -> str | None:
        """Apply a dead letter's body through `effect` as a first receipt, and forget it: the
        dedupe status (stored, duplicate: applied meanwhile; conflict: kept), or None when
        there is no such dead letter. An effect that raises leaves it dead and propagates."""

        def store() -> str | None:
            with self._engine.begin() as conn:
                row = conn.execute(sql.select_dead_letter(reply_id)).first()
                if row is None:
                    return None
                decided = self._accept_in(conn, [reply_id], [bytes(row.body)], effect, False)
                [status] = decided.statuses
                if status != "conflict":
                    conn.execute(sql.delete_dead_letter(reply_id))
                return status

        with _unavailable_when_it_fails():
            return retry.quickly(store, retry_if=self._worth_another_try, tries=_TRIES)

    def purge_dead(self, reply_id: str | None = None, *, older_than: float | None = None) -> int:
        """Forget one dead letter (`reply_id`), or those dead for over `older_than` seconds."""
        if (reply_id is None) == (older_than is None):
            raise ValueError("give a reply_id or older_than, not both")
        with _unavailable_when_it_fails(), self._engine.begin() as conn:
            if reply_id is not None:
                statement = sql.delete_dead_letter(reply_id)
            else:
                assert older_than is not None
                cutoff = now_expression(self.clock, self._dialect) - older_than
                statement = sql.delete_dead_before(cutoff)
            return int(conn.execute(statement).rowcount)

    def _read_all(self, query: sa.Select[Any]) -> list[Any]:
        """Every row of a read; a connection found dropped is replaced."""

        def read() -> list[Any]:
            with self._engine.connect().execution_options(**{READ_ONLY: True}) as conn:
                return list(conn.execute(query).all())

        with _unavailable_when_it_fails():
            return retry.quickly(read, retry_if=self._worth_another_try, tries=_TRIES)

    def _read_one(self, query: sa.Select[Any]) -> Any:
        """The first row of a read; a connection found dropped is replaced."""

        def read() -> Any:
            with self._engine.connect().execution_options(**{READ_ONLY: True}) as conn:
                return conn.execute(query).first()

        with _unavailable_when_it_fails():
            return retry.quickly(read, retry_if=self._worth_another_try, tries=_TRIES)

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
            with _unavailable_when_it_fails(), self._engine.begin() as conn:
                cutoff = now_expression(self.clock, self._dialect) - older_than
                count = conn.execute(sql.delete_oldest(cutoff, batch)).rowcount
            removed += count
            if count < batch:
                return removed
