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
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from outbox import failpoints
from outbox.canonical import sha256_hex
from outbox.clock import Clock
from outbox.db.dialect import READ_ONLY, database_now, insert_ignoring_conflicts, now_expression
from outbox.db.handle import DatabaseHandle
from outbox.errors import PayloadCollision, StoreUnavailable
from outbox.messages import check_reply_id
from outbox.migrations import RECEIVER_BRANCH
from receiver.schema import effects, receipts

DEFAULT_RETENTION = 30 * 86_400.0
PURGE_BATCH = 1000
# A race with purge, or a serialization failure under a stricter isolation level.
_ATTEMPTS = 3

#: Keys of ``session.info`` an effect can read.
REPLY_ID_KEY = "receiver.reply_id"
RECEIVED_AT_KEY = "receiver.received_at"

Effect = Callable[[Session, bytes], None]


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
    record_effects(session, [(session.info[REPLY_ID_KEY], session.info[RECEIVED_AT_KEY], body)])


# Driver SQL for psycopg: %(name)b sends an array in binary, where the text format would
# escape every element with a regular expression on the client.
_INSERT_EFFECTS_POSTGRESQL = (
    "INSERT INTO receiver_effects (reply_id, created_at, body) "
    "SELECT * FROM unnest("
    "CAST(%(ids)b AS varchar[]), CAST(%(times)b AS float8[]), CAST(%(bodies)b AS bytea[]))"
)


def record_effects(session: Session, fresh: Sequence[tuple[str, float, bytes]]) -> None:
    """The reference effect for a batch: one statement for every first receipt."""
    _insert_effects(session.connection(), fresh)


def _insert_effects(conn: sa.Connection, fresh: Sequence[tuple[str, float, bytes]]) -> None:
    if conn.dialect.name == "postgresql":
        # Arrays keep it one short statement: an executemany costs a round trip per row.
        conn.exec_driver_sql(
            _INSERT_EFFECTS_POSTGRESQL,
            {
                "ids": [r for r, _, _ in fresh],
                "times": [at for _, at, _ in fresh],
                "bodies": [body for _, _, body in fresh],
            },
        )
        return
    conn.execute(
        effects.insert(),
        [{"reply_id": r, "created_at": at, "body": body} for r, at, body in fresh],
    )


record_effect.many = record_effects  # type: ignore[attr-defined]


def run_effects(
    conn: sa.Connection, effect: Effect, fresh: Sequence[tuple[str, float, bytes]]
) -> None:
    """Run `effect` for each first receipt in one Session on the receipts' transaction.

    An effect that also has a `many(session, [(reply_id, received_at, body)])`
    attribute gets the whole batch in one call, so it can write in bulk.
    """
    if effect is record_effect:
        # The reference effect needs no Session: building one per request costs more
        # than the insert itself.
        _insert_effects(conn, fresh)
        return
    session = Session(bind=conn)
    try:
        many = getattr(effect, "many", None)
        if many is not None:
            many(session, fresh)
        else:
            for reply_id, received_at, body in fresh:
                session.info[REPLY_ID_KEY] = reply_id
                session.info[RECEIVED_AT_KEY] = received_at
                effect(session, body)
        session.flush()
    finally:
        # The session joined our transaction: closing it neither commits nor rolls back.
        session.close()


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
    """A dropped connection, serialization failure or deadlock: a second try may well pass.

    Retrying after a COMMIT that failed is safe: the receipt makes the resend a duplicate.
    """
    if exc.connection_invalidated:
        return True
    try:
        from psycopg import errors as pg_errors
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return False
    return isinstance(exc.orig, pg_errors.SerializationFailure | pg_errors.DeadlockDetected) or (
        isinstance(exc.orig, pg_errors.UniqueViolation)
        and exc.orig.diag.table_name == receipts.name
    )


# Three array parameters instead of thousands of scalars: one short, cacheable statement
# whatever the batch size, its arrays sent in binary (see _INSERT_EFFECTS_POSTGRESQL).
# %(now)s is a manual clock's time, or NULL for the database's (no extra round trip).
_INSERT_RECEIPTS_POSTGRESQL = (
    "INSERT INTO receiver_receipts (reply_id, content_hash, body, received_at) "
    "SELECT t.reply_id, t.content_hash, t.body, "
    f"COALESCE(%(now)s::float8, {database_now('postgresql')}) FROM unnest("
    "CAST(%(ids)b AS varchar[]), CAST(%(hashes)b AS varchar[]), CAST(%(bodies)b AS bytea[])"
    ") AS t(reply_id, content_hash, body) "
    "ON CONFLICT (reply_id) DO NOTHING RETURNING reply_id, received_at"
)
# The reference effect rides on the same statement: the rows the receipt insert returns
# (first receipts only) are its effect rows. One round trip and one parse fewer per
# request than running it after the insert.
_INSERT_RECEIPTS_AND_EFFECTS_POSTGRESQL = (
    f"WITH new AS ({_INSERT_RECEIPTS_POSTGRESQL}, body), "
    "effect AS (INSERT INTO receiver_effects (reply_id, created_at, body) "
    "SELECT reply_id, received_at, body FROM new) "
    "SELECT reply_id, received_at FROM new"
)


class ReceiptStore(DatabaseHandle):
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
        # No ping per checkout (a round trip per request): a connection found dropped
        # fails its statement, and accept and the reads retry on a fresh one.
        self._open(url_or_engine, RECEIVER_BRANCH, pool_pre_ping=False)
        self._autocommit = self._engine.execution_options(isolation_level="AUTOCOMMIT")

    def _check_schema(self, branch: str) -> None:
        with self._translated():
            super()._check_schema(branch)

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
        run = self.effect if effect is None else effect
        # On PostgreSQL the reference effect is written by the receipt insert itself. That
        # one statement is then the whole transaction, so it runs in autocommit: no BEGIN
        # and COMMIT round trips, and "before commit" is before that statement.
        fused = run is record_effect and self._dialect == "postgresql"
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with (
                    self._translated(retry=True),
                    self._autocommit.connect() if fused else self._engine.begin() as conn,
                ):
                    if fused:
                        failpoints.hit("receiver.before_commit")
                    results = self._accept_in(conn, data, run, fused)
                    if not fused:
                        failpoints.hit("receiver.before_commit")
            except _Retry as exc:
                if attempt == _ATTEMPTS:
                    raise StoreUnavailable("kept losing races to store receipts; try again") from (
                        exc.__cause__
                    )
                continue
            failpoints.hit("receiver.after_commit")
            return results
        raise AssertionError("unreachable")  # pragma: no cover

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
        inserted = self._insert_new(
            conn,
            [(reply_id, digests[i], items[i][1]) for reply_id, i in first.items()],
            with_reference_effect=fused,
        )
        missing = [reply_id for reply_id in first if reply_id not in inserted]
        held = (
            {
                row.reply_id: (row.content_hash, float(row.received_at))
                for row in conn.execute(
                    sa.select(
                        receipts.c.reply_id, receipts.c.content_hash, receipts.c.received_at
                    ).where(receipts.c.reply_id.in_(missing))
                )
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
                raise _Retry  # purged between our insert and our read
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

    def _insert_new(
        self,
        conn: sa.Connection,
        rows: Sequence[tuple[str, str, bytes]],
        with_reference_effect: bool = False,
    ) -> dict[str, float]:
        """Insert receipts unless stored; returns reply_id -> received_at of the new ones."""
        if self._dialect == "postgresql":
            result = conn.exec_driver_sql(
                _INSERT_RECEIPTS_AND_EFFECTS_POSTGRESQL
                if with_reference_effect
                else _INSERT_RECEIPTS_POSTGRESQL,
                {
                    "now": None if self.clock is None else float(self.clock()),
                    "ids": [r[0] for r in rows],
                    "hashes": [r[1] for r in rows],
                    "bodies": [r[2] for r in rows],
                },
            )
        else:
            result = conn.execute(
                insert_ignoring_conflicts(receipts, self._dialect)
                .values(received_at=now_expression(self.clock, self._dialect))
                .returning(receipts.c.reply_id, receipts.c.received_at),
                [{"reply_id": r[0], "content_hash": r[1], "body": r[2]} for r in rows],
            )
        return {row.reply_id: float(row.received_at) for row in result.all()}

    def lookup(self, reply_id: str) -> Receipt | None:
        """The stored receipt of `reply_id` (duplicate=True: it predates this call), or None."""
        row = self._read_one(
            sa.select(receipts.c.content_hash, receipts.c.received_at).where(
                receipts.c.reply_id == reply_id
            )
        )
        if row is None:
            return None
        return Receipt(reply_id, row.content_hash, float(row.received_at), duplicate=True)

    def body(self, reply_id: str) -> bytes | None:
        """The exact body stored for `reply_id`, or None."""
        row = self._read_one(sa.select(receipts.c.body).where(receipts.c.reply_id == reply_id))
        return None if row is None else bytes(row.body)

    def _read_one(self, query: sa.Select[Any]) -> Any:
        """The first row of a read; a connection found dropped is replaced once."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with (
                    self._translated(retry=True),
                    self._engine.connect().execution_options(**{READ_ONLY: True}) as conn,
                ):
                    return conn.execute(query).first()
            except _Retry as exc:
                if attempt == _ATTEMPTS:
                    raise StoreUnavailable("receipt database unavailable") from exc.__cause__
        raise AssertionError("unreachable")  # pragma: no cover

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
