"""ReceiptStore: dedupe by reply_id plus the hash of the exact body, effect committed once.

``accept`` runs one transaction: insert the receipt unless its reply_id is
already stored (an insert that ignores conflicts, with RETURNING to tell a
fresh row from an existing one), then either run the effect (fresh) or compare
content hashes (existing: same hash is a duplicate, another is a
PayloadCollision). Concurrent identical requests therefore serialize on the
primary key: on PostgreSQL the losers' ``ON CONFLICT DO NOTHING`` waits for the
winner to commit and then reads its row; on SQLite ``BEGIN IMMEDIATE`` admits
one writer at a time.

Errors (outbox.errors): PayloadCollision (same reply_id, other body; nothing
changed), StoreUnavailable (the database cannot be reached or kept failing
transiently: try again later), SchemaNotReady (the receiver tables are missing
or too old).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import failpoints
from outbox.canonical import sha256_hex
from outbox.clock import Clock
from outbox.db import retry
from outbox.db.dialect import READ_ONLY, is_postgresql, now_expression, one_statement
from outbox.db.handle import DatabaseHandle
from outbox.durations import duration_text
from outbox.errors import PayloadCollision, StoreUnavailable
from outbox.messages import are_reply_ids, check_reply_id
from outbox.migrations import RECEIVER_BRANCH
from receiver import sql
from receiver.effects import Effect, record_effect, run_effects
from receiver.schema import receipts

DEFAULT_RETENTION = 30 * 86_400.0
PURGE_BATCH = 1000
# Tries of one transaction: a dropped connection, a serialization failure or a race with
# purge is resolved by a second try; a third failure means the database is not well.
_TRIES = 3


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


@contextmanager
def _unavailable_when_it_fails() -> Iterator[None]:
    """Say StoreUnavailable for what a later try may pass: pool exhausted, transient errors."""
    try:
        yield
    except sa.exc.TimeoutError as exc:  # pool exhausted: the same advice as a busy server
        raise StoreUnavailable(f"no database connection available: {exc}") from exc
    except _LostRace as exc:
        raise StoreUnavailable("kept losing races to store receipts; try again") from exc
    except sa.exc.DBAPIError as exc:
        if _lost_race(exc):
            raise StoreUnavailable("kept losing races to store receipts; try again") from exc
        # Cannot talk to the database, rather than a bad statement: a later try may pass.
        unreachable = isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError)
        if unreachable or retry.is_transient(exc):
            raise StoreUnavailable(f"receipt database unavailable: {exc.orig}") from exc
        raise


@dataclass(frozen=True)
class Receipt:
    """A stored receipt; `duplicate` says it was already stored before this call."""

    reply_id: str
    content_hash: str
    received_at: float
    duplicate: bool


def _check_item(reply_id: object, body: object, checked_id: bool) -> None:
    if not checked_id:
        check_reply_id(reply_id)
    if not isinstance(body, bytes | bytearray | memoryview):
        raise TypeError(f"body must be bytes, not {type(body).__name__}")


class _Decided(NamedTuple):
    """What one transaction decided: a status per item, and what accept() reports from it."""

    statuses: list[str]
    digests: list[str]
    inserted: dict[str, float]
    """received_at of each receipt this transaction stored."""
    held: dict[str, tuple[str, float]]
    """content hash and received_at of each receipt that was stored before it."""


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
        self, items: Sequence[tuple[str, bytes]], effect: Effect | None = None
    ) -> list[str]:
        """Store many receipts in ONE transaction, deduped per item: stored|duplicate|conflict."""
        return self._accept_all(items, effect).statuses

    def _accept_all(self, items: Sequence[tuple[str, bytes]], effect: Effect | None) -> _Decided:
        reply_ids = [reply_id for reply_id, _ in items]
        # One pass for the usual batch; a bad one is then found and named.
        checked_ids = are_reply_ids(reply_ids)
        for reply_id, body in items:
            _check_item(reply_id, body, checked_ids)
        bodies = [bytes(body) for _, body in items]
        run = effect
        # On PostgreSQL the reference effect is written by the receipt insert itself. That
        # one statement is then the whole transaction: it runs in autocommit (see
        # one_statement for where "before commit" is then).
        fused = run is record_effect and is_postgresql(self._dialect)

        def store() -> _Decided:
            with one_statement(self._engine, "receiver.before_commit", single=fused) as conn:
                decided = self._accept_in(conn, reply_ids, bodies, run, fused)
                if decided.inserted:
                    failpoints.hit("receiver.before_commit")
                return decided

        with _unavailable_when_it_fails():
            # A second try after a COMMIT that failed is safe: the receipt makes it a duplicate.
            decided = retry.quickly(store, retry_if=self._worth_another_try, tries=_TRIES)
        failpoints.hit("receiver.after_commit")
        return decided

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
        return _Decided(statuses, digests, inserted, held)

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
