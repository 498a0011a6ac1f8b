"""ReceiptStore on both backends: dedupe, collisions, effects, failpoints, lookup, purge."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.db_faults import terminate_other_sessions
from support.receiver_helpers import count_effects, refused_connection, stored_receipts

import outbox
import receiver
from outbox import PayloadCollision, SchemaNotReady, failpoints
from outbox.canonical import sha256_hex
from outbox.receiver_tables import effects
from outbox.testing import ManualClock
from receiver import Receipt, ReceiptStore, StoreUnavailable
from receiver.effects import REPLY_ID_KEY, record_effect

DAY = 86_400.0


@pytest.fixture
def store(db_url: str, clock: ManualClock) -> Iterator[ReceiptStore]:
    """A store on the current backend with a manual clock."""
    s = ReceiptStore(db_url, clock=clock)
    yield s
    s.close()


def test_public_names_are_the_contract() -> None:
    assert sorted(receiver.__all__) == [
        "NatsConsumer",
        "RabbitMQConsumer",
        "Receipt",
        "ReceiptStore",
        "StoreUnavailable",
        "create_app",
        "is_reply_id",
        "upgrade",
        "verify",
    ]


def test_first_receipt_runs_the_effect_once(
    store: ReceiptStore, db_url: str, clock: ManualClock
) -> None:
    first = store.accept("r-1", b'{"a":1}', record_effect)
    assert first == Receipt("r-1", sha256_hex(b'{"a":1}'), clock(), duplicate=False)
    clock.advance(5)
    again = store.accept("r-1", b'{"a":1}', record_effect)
    assert again == Receipt("r-1", first.content_hash, first.received_at, duplicate=True)
    assert count_effects(db_url, "r-1") == 1
    assert stored_receipts(db_url) == {"r-1": b'{"a":1}'}


def test_same_id_other_bytes_is_a_collision_and_changes_nothing(
    store: ReceiptStore, db_url: str
) -> None:
    store.accept("r-1", b'{"a":1}', record_effect)
    with pytest.raises(PayloadCollision, match="r-1"):
        store.accept(
            "r-1", b'{"a": 1}', record_effect
        )  # same JSON value, other bytes: still a collision
    assert stored_receipts(db_url) == {"r-1": b'{"a":1}'}
    assert count_effects(db_url) == 1


def test_custom_effect_joins_the_transaction(store: ReceiptStore, db_url: str) -> None:
    seen: list[tuple[str, bytes]] = []

    def effect(session: Session, body: bytes) -> None:
        seen.append((session.info[REPLY_ID_KEY], body))
        session.execute(effects.insert().values(reply_id="custom", body=body, created_at=1.0))

    store.accept("r-1", b"{}", effect)
    store.accept("r-1", b"{}", effect)
    assert seen == [("r-1", b"{}")]
    assert count_effects(db_url, "custom") == 1
    assert count_effects(db_url, "r-1") == 0  # the custom effect replaces the reference one


def test_a_failing_effect_rolls_the_receipt_back(store: ReceiptStore, db_url: str) -> None:
    def broken(session: Session, body: bytes) -> None:
        session.execute(effects.insert().values(reply_id="r-1", body=body, created_at=1.0))
        raise RuntimeError("business rule failed")

    with pytest.raises(RuntimeError, match="business rule"):
        store.accept("r-1", b"{}", broken)
    assert stored_receipts(db_url) == {}
    assert count_effects(db_url) == 0
    assert store.accept("r-1", b"{}", record_effect).duplicate is False
    assert count_effects(db_url) == 1


def test_crash_before_commit_leaves_nothing(store: ReceiptStore, db_url: str) -> None:
    with failpoints.arm("receiver.before_commit"), pytest.raises(failpoints.Crash):
        store.accept("r-1", b"{}", record_effect)
    assert stored_receipts(db_url) == {}
    assert count_effects(db_url) == 0


def test_crash_after_commit_is_a_lost_ack_then_a_duplicate(
    store: ReceiptStore, db_url: str
) -> None:
    with failpoints.arm("receiver.after_commit"), pytest.raises(failpoints.Crash):
        store.accept("r-1", b"{}", record_effect)
    assert count_effects(db_url) == 1
    assert store.accept("r-1", b"{}", record_effect).duplicate is True
    assert count_effects(db_url) == 1


def test_lookup_and_body(store: ReceiptStore, clock: ManualClock) -> None:
    assert store.lookup("r-1") is None
    assert store.body("r-1") is None
    stored = store.accept("r-1", b"[1]", record_effect)
    assert store.lookup("r-1") == Receipt("r-1", stored.content_hash, clock(), duplicate=True)
    assert store.body("r-1") == b"[1]"


@pytest.mark.parametrize("reply_id", ["", "a.b", "a b", "x" * 201, "é", 17])
def test_invalid_reply_ids_are_refused(store: ReceiptStore, reply_id: object) -> None:
    with pytest.raises(ValueError, match="reply_id"):
        store.accept(reply_id, b"{}", record_effect)  # type: ignore[arg-type]


def test_purge_respects_the_retention(store: ReceiptStore, db_url: str, clock: ManualClock) -> None:
    for index in range(5):
        store.accept(f"old-{index}", b"{}", record_effect)
    clock.advance(10 * DAY)
    store.accept("young", b"{}", record_effect)
    clock.advance(25 * DAY)  # the old ones are 35 days old, "young" 25
    with pytest.raises(ValueError, match="retention"):
        store.purge(7 * DAY)
    assert store.purge(30 * DAY, batch=2) == 5
    assert set(stored_receipts(db_url)) == {"young"}
    assert count_effects(db_url) == 6  # effects are business data, never purged
    assert store.purge(30 * DAY) == 0


def test_a_shorter_retention_must_be_explicit(db_url: str, clock: ManualClock) -> None:
    with ReceiptStore(db_url, clock=clock, retention=DAY) as short:
        short.accept("r-1", b"{}", record_effect)
        clock.advance(2 * DAY)
        assert short.purge(DAY) == 1


def test_unmigrated_database_fails_clearly(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'blank.db'}"
    outbox.upgrade(url)  # outbox tables only: the receiver branch is missing
    with pytest.raises(SchemaNotReady, match="receiver"):
        ReceiptStore(url)


def test_unreachable_database_is_store_unavailable(db_url: str, backend: str) -> None:
    engine = outbox.create_engine(db_url)
    store = ReceiptStore(engine)
    down = False

    @sa.event.listens_for(engine, "do_connect")
    def refuse(*args: object) -> None:
        if down:
            raise refused_connection(backend)

    try:
        engine.dispose()
        down = True
        with pytest.raises(StoreUnavailable):
            store.accept("r-1", b"{}", record_effect)
        with pytest.raises(StoreUnavailable):
            store.lookup("r-1")
        down = False
        assert store.accept("r-1", b"{}", record_effect).duplicate is False
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_pooled_connections_dropped_under_the_store_are_replaced(
    store: ReceiptStore, db_url: str
) -> None:
    # The store does not ping each connection it checks out; a dropped one must cost a
    # retry, not a failed request.
    store.accept("r-1", b'{"a":1}', record_effect)
    assert store.lookup("r-1") is not None
    assert terminate_other_sessions(db_url) >= 1
    assert store.accept("r-2", b'{"a":2}', record_effect).duplicate is False
    assert terminate_other_sessions(db_url) >= 1
    found = store.lookup("r-1")
    assert found is not None
    assert found.content_hash == sha256_hex(b'{"a":1}')
    assert terminate_other_sessions(db_url) >= 1
    assert store.body("r-2") == b'{"a":2}'
    assert (count_effects(db_url, "r-1"), count_effects(db_url, "r-2")) == (1, 1)


def test_accept_without_an_effect_stores_the_receipt_and_nothing_else(db_url: str) -> None:
    with ReceiptStore(db_url) as store:
        assert store.accept("r-1", b"{}").duplicate is False
        assert store.accept("r-1", b"{}").duplicate is True
        assert store.accept_many([("r-2", b"[]")]) == ["stored"]
    assert set(stored_receipts(db_url)) == {"r-1", "r-2"}
    assert count_effects(db_url) == 0


def _effect_rows(url: str) -> list[tuple[str, float, bytes]]:
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.select(effects.c.reply_id, effects.c.created_at, effects.c.body)
            return sorted((r, float(at), bytes(b)) for r, at, b in conn.execute(query))
    finally:
        engine.dispose()


def _record_one_by_one(session: Session, body: bytes) -> None:
    """The reference effect without its batch form: the path an application's effect takes."""
    record_effect(session, body)


@pytest.mark.parametrize("effect", [record_effect, _record_one_by_one], ids=["fused", "own"])
def test_a_batch_decides_repeats_within_it_and_receipts_stored_before(
    store: ReceiptStore, db_url: str, clock: ManualClock, effect: object
) -> None:
    store.accept("held", b'{"h":1}', record_effect)
    held_at = clock()
    clock.advance(7)
    items = [
        ("a", b'{"a":1}'),
        ("held", b'{"h":1}'),  # stored before, same body
        ("a", b'{"a":1}'),  # repeated in the batch, same body
        ("b", b'{"b":1}'),
        ("a", b'{"a":2}'),  # repeated in the batch, other body
        ("held", b'{"h":2}'),  # stored before, other body
    ]
    statuses = store.accept_many(items, effect)  # type: ignore[arg-type]
    assert statuses == ["stored", "duplicate", "duplicate", "stored", "conflict", "conflict"]
    assert stored_receipts(db_url) == {"held": b'{"h":1}', "a": b'{"a":1}', "b": b'{"b":1}'}
    assert _effect_rows(db_url) == [
        ("a", clock(), b'{"a":1}'),
        ("b", clock(), b'{"b":1}'),
        ("held", held_at, b'{"h":1}'),
    ]
    assert store.accept("a", b'{"a":1}') == Receipt(
        "a", sha256_hex(b'{"a":1}'), clock(), duplicate=True
    )
    with pytest.raises(PayloadCollision, match=sha256_hex(b'{"a":1}')):
        store.accept("a", b'{"a":3}')


def _application_effect(session: Session, body: bytes) -> None:
    """An effect of an application's own: one receiver_effects row."""
    record_effect(session, body)


@pytest.mark.parametrize(
    ("effect", "transactions"),
    [(None, 0), (record_effect, 0), (_application_effect, 1)],
    ids=["no-effect", "reference", "application"],
)
def test_a_batch_is_one_statement_in_autocommit_unless_an_effect_needs_a_transaction(
    db_url: str, backend: str, effect: Any, transactions: int
) -> None:
    # The receipt insert alone, or with the reference effect written by it, is the whole
    # transaction on PostgreSQL: BEGIN and COMMIT would only add round trips.
    engine = outbox.create_engine(db_url)
    committed = [0]
    sa.event.listen(engine, "commit", lambda *args: committed.__setitem__(0, committed[0] + 1))
    store = ReceiptStore(engine)
    try:
        batch = [(f"one-{n}", b'{"n": %d}' % n) for n in range(3)]
        assert store.accept_many(batch, effect) == ["stored"] * 3
    finally:
        store.close()
        engine.dispose()
    assert committed[0] == (transactions if backend == "postgresql" else 1)
    assert count_effects(db_url) == (0 if effect is None else 3)
