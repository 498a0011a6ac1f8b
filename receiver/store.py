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
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import failpoints
from outbox.canonical import sha256_hex
from outbox.clock import Clock
from outbox.db import retry
from outbox.db.dialect import READ_ONLY, is_postgresql, now_expression, one_statement
from outbox.db.handle import DatabaseHandle
from outbox.errors import PayloadCollision, StoreUnavailable
from outbox.messages import check_reply_id
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


def _check_item(reply_id: object, body: object) -> None:
    check_reply_id(reply_id)
    if not isinstance(body, bytes | bytearray | memoryview):
        raise TypeError(f"body must be bytes, not {type(body).__name__}")


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
        [result] = self._accept_all([(reply_id, body)], effect)
        if isinstance(result, PayloadCollision):
            raise result
        return result

    def accept_many(
        self, items: Sequence[tuple[str, bytes]], effect: Effect | None = None
    ) -> list[str]:
        """Store many receipts in ONE transaction, deduped per item: stored|duplicate|conflict."""
        return [
            "conflict"
            if isinstance(result, PayloadCollision)
            else "duplicate"
            if result.duplicate
            else "stored"
            for result in self._accept_all(items, effect)
        ]

    def _accept_all(
        self, items: Sequence[tuple[str, bytes]], effect: Effect | None
    ) -> list[Receipt | PayloadCollision]:
        for reply_id, body in items:
            _check_item(reply_id, body)
        data = [(reply_id, bytes(body)) for reply_id, body in items]
        run = effect
        # On PostgreSQL the reference effect is written by the receipt insert itself. That
        # one statement is then the whole transaction: it runs in autocommit, and "before
        # commit" is before that statement.
        fused = run is record_effect and is_postgresql(self._dialect)

        def store() -> list[Receipt | PayloadCollision]:
            with one_statement(self._engine, "receiver.before_commit", single=fused) as conn:
                return self._accept_in(conn, data, run, fused)

        with _unavailable_when_it_fails():
            # A second try after a COMMIT that failed is safe: the receipt makes it a duplicate.
            results = retry.quickly(store, retry_if=self._worth_another_try, tries=_TRIES)
        failpoints.hit("receiver.after_commit")
        return results

    def _accept_in(
        self,
        conn: sa.Connection,
        items: Sequence[tuple[str, bytes]],
        effect: Effect | None,
        fused: bool,
    ) -> list[Receipt | PayloadCollision]:
        """Insert receipts in bulk; run the effect on each first receipt (`fused`: the insert's)."""
        digests = [sha256_hex(body) for _, body in items]
        first: dict[str, int] = {}
        for index, (reply_id, _) in enumerate(items):
            first.setdefault(reply_id, index)
        inserted = sql.insert_receipts(
            conn,
            [(reply_id, digests[i], items[i][1]) for reply_id, i in first.items()],
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
        results: list[Receipt | PayloadCollision] = []
        fresh: list[tuple[str, float, bytes]] = []
        for index, (reply_id, body) in enumerate(items):
            digest = digests[index]
            if reply_id in inserted and first[reply_id] == index:
                results.append(Receipt(reply_id, digest, inserted[reply_id], duplicate=False))
                fresh.append((reply_id, inserted[reply_id], body))
                continue
            if reply_id in inserted:
                stored_hash, received_at = digests[first[reply_id]], inserted[reply_id]
            elif reply_id in held:
                stored_hash, received_at = held[reply_id]
            else:
                raise _LostRace  # purged between our insert and our read
            if stored_hash == digest:
                results.append(Receipt(reply_id, digest, received_at, duplicate=True))
            else:
                results.append(
                    PayloadCollision(
                        f"reply_id {reply_id!r} is stored with content hash {stored_hash}; "
                        f"this body hashes to {digest}"
                    )
                )
        if effect is not None and fresh and not fused:
            run_effects(conn, effect, fresh)
        return results

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
                f"({self.retention:g}s): a relay may still resend them; lower the retention "
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
