"""ReceiptStore: dedupe by reply_id plus the hash of the exact body, effect committed once.

``accept`` runs one transaction: insert the receipt unless its reply_id is
already stored (an insert that ignores conflicts, with RETURNING to tell a
fresh row from an existing one), then either run the effect (fresh) or compare
content hashes (existing: same hash is a duplicate, another is a
PayloadCollision). Concurrent identical requests therefore serialize on the
primary key: on PostgreSQL the losers' ``ON CONFLICT DO NOTHING`` waits for the
winner to commit and then reads its row; on SQLite ``BEGIN IMMEDIATE`` admits
one writer at a time.

Errors:
PayloadCollision   (outbox.errors) same reply_id, other body; nothing changed
StoreUnavailable   the database cannot be reached or stayed busy: try again later
SchemaNotReady     (outbox.errors) the receiver tables are missing or too old
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from outbox import failpoints
from outbox._dialect import READ_ONLY, insert_ignoring_conflicts
from outbox.canonical import sha256_hex
from outbox.clock import Clock, now_expression
from outbox.errors import OutboxError, PayloadCollision
from outbox.messages import check_reply_id
from outbox.migrations import RECEIVER_BRANCH, engine_for, ensure_current
from receiver.schema import effects, receipts

DEFAULT_RETENTION = 30 * 86_400.0
PURGE_BATCH = 1000
# A race with purge, or a serialization failure under a stricter isolation level.
_ATTEMPTS = 3

#: Keys of ``session.info`` an effect can read.
REPLY_ID_KEY = "receiver.reply_id"
RECEIVED_AT_KEY = "receiver.received_at"

Effect = Callable[[Session, bytes], None]


class StoreUnavailable(OutboxError):
    """The receipt database is unreachable or busy; nothing is known to be stored: retry."""


class _Retry(Exception):
    """The transaction lost a race it can win on a second try."""


@dataclass(frozen=True)
class Receipt:
    """A stored receipt; `duplicate` says it was already stored before this call."""

    reply_id: str
    content_hash: str
    received_at: float
    duplicate: bool


def record_effect(session: Session, body: bytes) -> None:
    """The reference effect: one receiver_effects row per first receipt (joins the transaction)."""
    session.execute(
        effects.insert().values(
            reply_id=session.info[REPLY_ID_KEY],
            body=body,
            created_at=session.info[RECEIVED_AT_KEY],
        )
    )


def _check_item(reply_id: object, body: object) -> None:
    check_reply_id(reply_id)
    if not isinstance(body, bytes | bytearray | memoryview):
        raise TypeError(f"body must be bytes, not {type(body).__name__}")


def _unreachable(exc: sa.exc.DBAPIError) -> bool:
    """Whether a database error means "cannot talk to the database" rather than a bad statement."""
    return isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError) or bool(
        exc.connection_invalidated
    )


def _retryable(exc: sa.exc.DBAPIError) -> bool:
    """A serialization failure or deadlock: the same transaction may well pass next time."""
    try:
        from psycopg import errors as pg_errors
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return False
    return isinstance(exc.orig, pg_errors.SerializationFailure | pg_errors.DeadlockDetected) or (
        isinstance(exc.orig, pg_errors.UniqueViolation)
        and exc.orig.diag.table_name == receipts.name
    )


class ReceiptStore:
    """Receipts deduplicated by reply_id and body hash; the effect commits with the receipt."""

    def __init__(
        self,
        url_or_engine: str | sa.URL | Engine,
        *,
        clock: Clock | None = None,
        retention: float = DEFAULT_RETENTION,
        effect: Effect | None = record_effect,
    ) -> None:
        """Open a store on a database upgraded with `receiver.upgrade` (SchemaNotReady if not)."""
        if isinstance(retention, bool) or not isinstance(retention, int | float) or retention <= 0:
            raise ValueError(f"retention must be a positive number of seconds, got {retention!r}")
        self.clock = clock
        self.retention = float(retention)
        self.effect = effect
        self._engine, self._owns_engine = engine_for(url_or_engine)
        try:
            with self._translated():
                ensure_current(self._engine, branch=RECEIVER_BRANCH)
        except BaseException:
            self.close()
            raise
        self._dialect = self._engine.dialect.name

    @property
    def engine(self) -> Engine:
        """The engine this store runs on."""
        return self._engine

    def close(self) -> None:
        """Release the connection pool when the store created it."""
        if self._owns_engine:
            self._engine.dispose()

    def __enter__(self) -> ReceiptStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _translated(self, retry: bool = False) -> Iterator[None]:
        try:
            yield
        except sa.exc.TimeoutError as exc:  # pool exhausted: the same advice as a busy server
            raise StoreUnavailable(f"no database connection available: {exc}") from exc
        except sa.exc.DBAPIError as exc:
            if retry and _retryable(exc):
                raise _Retry from exc
            if _unreachable(exc):
                raise StoreUnavailable(f"receipt database unavailable: {exc.orig}") from exc
            raise

    def accept(self, reply_id: str, body: bytes, effect: Effect | None = None) -> Receipt:
        """Store a receipt and run the effect once per reply_id; same id, other body: collision."""
        _check_item(reply_id, body)
        data = bytes(body)
        run = self.effect if effect is None else effect
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with self._translated(retry=True):
                    receipt = self._accept_once(reply_id, data, run)
            except _Retry as exc:
                if attempt == _ATTEMPTS:
                    raise StoreUnavailable(
                        f"reply {reply_id!r} kept losing races; try again"
                    ) from exc.__cause__
                continue
            failpoints.hit("receiver.after_commit")
            return receipt
        raise AssertionError("unreachable")  # pragma: no cover

    def _accept_once(self, reply_id: str, body: bytes, effect: Effect | None) -> Receipt:
        with self._engine.begin() as conn:
            receipt = self._accept_in(conn, reply_id, body, effect)
            failpoints.hit("receiver.before_commit")
        return receipt

    def accept_many(
        self, items: Sequence[tuple[str, bytes]], effect: Effect | None = None
    ) -> list[str]:
        """Store many receipts in ONE transaction, deduped per item: stored|duplicate|conflict."""
        for reply_id, body in items:
            _check_item(reply_id, body)
        run = self.effect if effect is None else effect
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with self._translated(retry=True), self._engine.begin() as conn:
                    statuses = []
                    for reply_id, body in items:
                        try:
                            receipt = self._accept_in(conn, reply_id, bytes(body), run)
                        except PayloadCollision:
                            statuses.append("conflict")
                            continue
                        statuses.append("duplicate" if receipt.duplicate else "stored")
                    failpoints.hit("receiver.before_commit")
            except _Retry as exc:
                if attempt == _ATTEMPTS:
                    raise StoreUnavailable("batch kept losing races; try again") from exc.__cause__
                continue
            failpoints.hit("receiver.after_commit")
            return statuses
        raise AssertionError("unreachable")  # pragma: no cover

    def _accept_in(
        self, conn: sa.Connection, reply_id: str, body: bytes, effect: Effect | None
    ) -> Receipt:
        """Insert one receipt on an open transaction, running the effect on first receipt."""
        digest = sha256_hex(body)
        inserted = conn.execute(
            insert_ignoring_conflicts(receipts, self._dialect)
            .values(
                reply_id=reply_id,
                content_hash=digest,
                body=body,
                received_at=now_expression(self.clock, self._dialect),
            )
            .returning(receipts.c.received_at)
        ).first()
        if inserted is None:
            existing = conn.execute(
                sa.select(receipts.c.content_hash, receipts.c.received_at).where(
                    receipts.c.reply_id == reply_id
                )
            ).first()
            if existing is None:
                raise _Retry  # purged between our insert and our read
            if existing.content_hash != digest:
                raise PayloadCollision(
                    f"reply_id {reply_id!r} is stored with content hash "
                    f"{existing.content_hash}; this body hashes to {digest}"
                )
            return Receipt(reply_id, digest, float(existing.received_at), duplicate=True)
        received_at = float(inserted.received_at)
        if effect is not None:
            session = Session(bind=conn)
            session.info[REPLY_ID_KEY] = reply_id
            session.info[RECEIVED_AT_KEY] = received_at
            try:
                effect(session, body)
                session.flush()
            finally:
                # The session joined our transaction: closing it neither commits nor rolls back.
                session.close()
        return Receipt(reply_id, digest, received_at, duplicate=False)

    def lookup(self, reply_id: str) -> Receipt | None:
        """The stored receipt of `reply_id` (duplicate=True: it predates this call), or None."""
        with (
            self._translated(),
            self._engine.connect().execution_options(**{READ_ONLY: True}) as conn,
        ):
            row = conn.execute(
                sa.select(receipts.c.content_hash, receipts.c.received_at).where(
                    receipts.c.reply_id == reply_id
                )
            ).first()
        if row is None:
            return None
        return Receipt(reply_id, row.content_hash, float(row.received_at), duplicate=True)

    def body(self, reply_id: str) -> bytes | None:
        """The exact body stored for `reply_id`, or None."""
        with (
            self._translated(),
            self._engine.connect().execution_options(**{READ_ONLY: True}) as conn,
        ):
            value = conn.execute(
                sa.select(receipts.c.body).where(receipts.c.reply_id == reply_id)
            ).scalar()
        return None if value is None else bytes(value)

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
            with self._translated(), self._engine.begin() as conn:
                cutoff = now_expression(self.clock, self._dialect) - older_than
                oldest = (
                    sa.select(receipts.c.reply_id)
                    .where(receipts.c.received_at < cutoff)
                    .order_by(receipts.c.received_at)
                    .limit(batch)
                )
                count = conn.execute(
                    receipts.delete().where(receipts.c.reply_id.in_(oldest))
                ).rowcount
            removed += count
            if count < batch:
                return removed
