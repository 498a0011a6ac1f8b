"""Keyed batches in ReceiptStore: an effect that fails holds back its key alone, in order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.receiver_helpers import count_effects, effects_refused, stored_receipts

import outbox
from outbox.errors import InvalidMessage
from receiver import ReceiptStore, StoreUnavailable
from receiver.effects import REPLY_ID_KEY, Effect, record_effect
from receiver.store import BatchItem

# Key A's second message fails; B and the unkeyed ones must not wait for it.
BATCH: list[BatchItem] = [
    ("a1", b'{"a":1}', "A"),
    ("b1", b'{"b":1}', "B"),
    ("a2", b'{"a":2}', "A"),
    ("u1", b'{"u":1}'),
    ("b2", b'{"b":2}', "B"),
    ("a3", b'{"a":3}', "A"),
    ("u2", b'{"u":2}', None),
    ("a4", b'{"a":4}', "A"),
]
FAILING = "a2"
EXPECTED = ["stored", "stored", "retry", "stored", "stored", "held", "stored", "held"]


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """The store's engine, so a test can watch its transactions."""
    made = outbox.create_engine(db_url)
    yield made
    made.dispose()


def commits_and_savepoints(engine: sa.Engine) -> dict[str, int]:
    """Counts of COMMITs and SAVEPOINTs the engine's connections issue from now on."""
    seen = {"commit": 0, "savepoint": 0}

    def count(name: str) -> Callable[..., None]:
        def counted(*args: object) -> None:
            seen[name] += 1

        return counted

    sa.event.listen(engine, "commit", count("commit"))
    sa.event.listen(engine, "savepoint", count("savepoint"))
    return seen


class FailsFor:
    """An application's effect: one receiver_effects row each, raising for the chosen ids."""

    def __init__(self, *reply_ids: str) -> None:
        self.failing = set(reply_ids)

    def __call__(self, session: Session, body: bytes) -> None:
        if session.info[REPLY_ID_KEY] in self.failing:
            raise RuntimeError("the application refused it")
        record_effect(session, body)


def failing_effect(kind: str, db_url: str) -> tuple[Effect, AbstractContextManager[object]]:
    """The effect under test and what makes it fail for FAILING: the reference effect (fused
    with the receipt insert on PostgreSQL) refused by the database, or an application's."""
    if kind == "reference":
        return record_effect, effects_refused(db_url, [FAILING])
    return FailsFor(FAILING), nullcontext()


@pytest.mark.parametrize("kind", ["reference", "application"])
def test_a_failing_effect_holds_back_the_later_items_of_its_key_alone(
    kind: str, db_url: str, engine: sa.Engine
) -> None:
    store = ReceiptStore(engine)
    effect, failing = failing_effect(kind, db_url)
    with failing:
        seen = commits_and_savepoints(engine)
        statuses = store.accept_many(BATCH, effect, isolate=True)
        assert statuses == EXPECTED
        assert list(statuses.errors) == [2]
        assert statuses.errors[2].startswith("effect raised ")
        assert seen["commit"] == 1  # the items that could be stored, in one transaction
    stored = {"a1", "b1", "u1", "b2", "u2"}
    assert set(stored_receipts(db_url)) == stored
    assert count_effects(db_url) == len(stored)
    assert all(count_effects(db_url, reply_id) == 1 for reply_id in stored)


@pytest.mark.parametrize("kind", ["reference", "application"])
def test_once_the_effect_passes_the_key_is_applied_in_order(
    kind: str, db_url: str, engine: sa.Engine
) -> None:
    store = ReceiptStore(engine)
    effect, failing = failing_effect(kind, db_url)
    with failing as refused:
        assert store.accept_many(BATCH, effect, isolate=True) == EXPECTED
        if kind == "reference":
            refused()  # type: ignore[operator]
        else:
            effect.failing.clear()  # type: ignore[attr-defined]
        order: list[str] = []

        def watching(session: Session, body: bytes) -> None:
            order.append(session.info[REPLY_ID_KEY])
            effect(session, body)

        again = store.accept_many(BATCH, watching, isolate=True)
    # a2 and the a3 and a4 it held are applied now; the rest were stored already.
    stored_now = {"a2", "a3", "a4"}
    assert again == ["stored" if i in stored_now else "duplicate" for i, *_ in BATCH]
    assert order == ["a2", "a3", "a4"]
    assert count_effects(db_url) == len(BATCH)


def test_a_batch_that_succeeds_takes_no_savepoint(db_url: str, engine: sa.Engine) -> None:
    store = ReceiptStore(engine)
    seen = commits_and_savepoints(engine)
    assert store.accept_many(BATCH, FailsFor(), isolate=True) == ["stored"] * len(BATCH)
    assert seen["savepoint"] == 0
    assert count_effects(db_url) == len(BATCH)


def test_without_isolate_a_failing_effect_still_fails_the_whole_batch(db_url: str) -> None:
    with ReceiptStore(db_url) as store, pytest.raises(RuntimeError, match="refused"):
        store.accept_many(BATCH, FailsFor(FAILING))
    assert stored_receipts(db_url) == {}
    assert count_effects(db_url) == 0


def test_a_database_that_fails_under_the_effect_fails_the_whole_batch(db_url: str) -> None:
    def connection_lost(session: Session, body: bytes) -> None:
        if session.info[REPLY_ID_KEY] == FAILING:
            raise sa.exc.OperationalError("INSERT", {}, ConnectionResetError("lost"))
        record_effect(session, body)

    with ReceiptStore(db_url) as store, pytest.raises(StoreUnavailable):
        store.accept_many(BATCH, connection_lost, isolate=True)
    assert stored_receipts(db_url) == {}


def test_a_repeated_reply_id_after_a_failed_one_is_tried_again(db_url: str) -> None:
    effect = FailsFor("a1")
    with ReceiptStore(db_url) as store:
        statuses = store.accept_many(
            [("a1", b"{}"), ("b1", b"{}"), ("a1", b"{}")], effect, isolate=True
        )
        assert statuses == ["retry", "stored", "retry"]
    assert set(stored_receipts(db_url)) == {"b1"}


@pytest.mark.parametrize("key", ["", "x" * 201, "tab\there", "é"])
def test_a_malformed_ordering_key_is_refused(db_url: str, key: str) -> None:
    with ReceiptStore(db_url) as store, pytest.raises(InvalidMessage, match="ordering_key"):
        store.accept_many([("a1", b"{}", key)], record_effect, isolate=True)
    assert stored_receipts(db_url) == {}
