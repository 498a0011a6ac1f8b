"""Poison messages: after max_deliveries failures of its effect a message goes dead, alone."""

from __future__ import annotations

import json
import logging

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.broker_messages import consumed, delivery
from support.db_faults import database_down
from support.receiver_helpers import SECRET, count_effects, stored_receipts

import outbox
from outbox.errors import ConfigError
from receiver import ReceiptStore
from receiver.consume import Consumer
from receiver.dead_letters import LastTry
from receiver.deliveries import Delivery
from receiver.effects import REPLY_ID_KEY, record_effect


class Refusing:
    """The reference effect, raising for the reply_ids in `failing` (the test may change it)."""

    def __init__(self, *failing: str) -> None:
        self.failing = set(failing)

    def __call__(self, session: Session, body: bytes) -> None:
        reply_id = session.info[REPLY_ID_KEY]
        if reply_id in self.failing:
            raise RuntimeError(f"{reply_id}: postgresql://app:hunter2@db/app refused it")
        record_effect(session, body)


def message(
    reply_id: str,
    key: str | None = None,
    *,
    redelivered: bool = False,
    signed: bool = False,
) -> Delivery:
    """A broker message as the relay publishes it (unsigned unless `signed`), with a
    traceparent of its own, kept in queue Q at 7."""
    return delivery(
        reply_id,
        key,
        secret=SECRET if signed else None,
        own={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
        redelivered=redelivered,
        broker_ref="Q/7",
    )


AT_ONCE = {"backoff": 1e-9, "backoff_cap": 1e-9}
"""A failed message may be tried again at once: these tests are about the count, not its
pace (test_a_message_is_tried_again_only_after_its_backoff is)."""


def test_a_message_whose_effect_keeps_raising_goes_dead_on_its_last_delivery(
    db_url: str, store: ReceiptStore, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = Consumer(store, unsigned=True, effect=Refusing("p1"), max_deliveries=3, **AT_ONCE)
    assert consumer.consume_batch_now([message("p1"), message("u1")]) == ["retry", "stored"]
    assert consumer.consume_batch_now([message("p1", redelivered=True)]) == ["retry"]
    assert store.dead_letters() == []
    with caplog.at_level(logging.ERROR, "outbox.receiver"):
        third = [message("p1", redelivered=True), message("u2")]
        assert consumer.consume_batch_now(third) == ["dead", "stored"]
    assert consumed(consumer.metrics, "dead") == 1
    assert consumed(consumer.metrics, "retry") == 2
    assert any(
        "p1" in r.getMessage() and "receiver_dead_letters" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR
    )
    [listed] = store.dead_letters()
    assert (listed["reply_id"], listed["failures"]) == ("p1", 3)
    letter = store.dead_letter("p1")
    assert letter is not None
    assert letter["reason"].startswith("RuntimeError: p1: postgresql://app:<redacted>@db/app")
    assert "hunter2" not in letter["reason"]
    assert letter["body"] == json.dumps({"reply": "p1"}).encode()
    assert letter["headers"]["webhook-id"] == "p1"
    assert "traceparent" in letter["headers"]
    assert letter["broker_ref"] == "Q/7"
    # Applied: the others. Not applied: the dead one, which has no receipt.
    assert set(stored_receipts(db_url)) == {"u1", "u2"}
    assert count_effects(db_url, "p1") == 0


def test_a_dead_letter_leaves_the_signature_out(store: ReceiptStore) -> None:
    consumer = Consumer(store, secrets=[SECRET], effect=Refusing("s1"), max_deliveries=1, **AT_ONCE)
    assert consumer.consume_batch_now([message("s1", signed=True)]) == ["dead"]
    letter = store.dead_letter("s1")
    assert letter is not None
    assert "webhook-signature" not in letter["headers"]
    assert "webhook-timestamp" in letter["headers"]


def test_a_dead_message_releases_its_key_in_its_batch_and_after(
    db_url: str, store: ReceiptStore
) -> None:
    effect = Refusing("a1", "c1")
    # Dead on its first delivery: the later message of its key in the same batch goes on.
    once = Consumer(store, unsigned=True, effect=effect, max_deliveries=1, **AT_ONCE)
    first = [message("a1", "A"), message("a2", "A"), message("b1", "B")]
    assert once.consume_batch_now(first) == ["dead", "stored", "stored"]
    # Across batches: the key's later messages wait while the blocker is retried (held,
    # in its batch and after), and go on once it is dead.
    consumer = Consumer(store, unsigned=True, effect=effect, max_deliveries=2, **AT_ONCE)
    assert consumer.consume_batch_now([message("c1", "C"), message("c2", "C")]) == ["retry", "held"]
    assert consumer.consume_batch_now([message("c3", "C"), message("d1", "D")]) == [
        "held",
        "stored",
    ]
    again = [message("c1", "C", redelivered=True), message("c2", "C", redelivered=True)]
    assert consumer.consume_batch_now(again) == ["dead", "held"]
    # c2, held beside c1's death, now blocks C: c3 waits for it, whichever comes back first.
    assert consumer.consume_batch_now([message("c3", "C", redelivered=True)]) == ["held"]
    later = [message("c2", "C", redelivered=True), message("c3", "C", redelivered=True)]
    assert consumer.consume_batch_now(later) == ["stored", "held"]
    assert consumer.consume_batch_now([message("c3", "C", redelivered=True)]) == ["stored"]
    assert set(stored_receipts(db_url)) == {"a2", "b1", "c2", "c3", "d1"}
    assert {row["reply_id"] for row in store.dead_letters()} == {"a1", "c1"}


def test_a_held_message_never_goes_dead(db_url: str, store: ReceiptStore) -> None:
    effect = Refusing("h1")
    consumer = Consumer(store, unsigned=True, effect=effect, max_deliveries=2, **AT_ONCE)
    assert consumer.consume_batch_now([message("h1", "H")]) == ["retry"]
    for _ in range(5):  # held far more often than max_deliveries: not a failure of its own
        assert consumer.consume_batch_now([message("h2", "H", redelivered=True)]) == ["held"]
    effect.failing.clear()
    batch = [message("h1", "H", redelivered=True), message("h2", "H", redelivered=True)]
    assert consumer.consume_batch_now(batch) == ["stored", "held"]
    assert consumer.consume_batch_now([message("h2", "H", redelivered=True)]) == ["stored"]
    assert store.dead_letters() == []
    assert consumed(consumer.metrics, "dead") == 0


def test_a_database_outage_does_not_count_towards_the_bound(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = outbox.create_engine(db_url)
    store = ReceiptStore(engine)
    consumer = Consumer(store, unsigned=True, effect=Refusing("o1"), max_deliveries=3, **AT_ONCE)
    try:
        assert consumer.consume_batch_now([message("o1")]) == ["retry"]
        with database_down(engine), caplog.at_level(logging.CRITICAL, "outbox.receiver"):
            for _ in range(5):
                assert consumer.consume_batch_now([message("o1", redelivered=True)]) == ["retry"]
        # The second and third failures of the effect itself: only the third buries it.
        assert consumer.consume_batch_now([message("o1", redelivered=True)]) == ["retry"]
        assert consumer.consume_batch_now([message("o1", redelivered=True)]) == ["dead"]
    finally:
        store.close()
        engine.dispose()


def test_a_dead_message_delivered_again_is_acknowledged_and_nothing_is_stored(
    db_url: str, store: ReceiptStore, caplog: pytest.LogCaptureFixture
) -> None:
    effect = Refusing("x1")
    consumer = Consumer(store, unsigned=True, effect=effect, max_deliveries=1, **AT_ONCE)
    assert consumer.consume_batch_now([message("x1")]) == ["dead"]
    effect.failing.clear()  # even an effect that would pass now is not run: retry is explicit
    with caplog.at_level(logging.WARNING, "outbox.receiver.consume"):
        # Its ack was lost after the commit that buried it: the broker delivers it again.
        assert consumer.consume_batch_now([message("x1", redelivered=True)]) == ["dead"]
    assert any("x1" in r.getMessage() and "dead letters" in r.getMessage() for r in caplog.records)
    assert stored_receipts(db_url) == {}
    assert len(store.dead_letters()) == 1
    # Retried by the operator: applied once, the dead letter gone; a retry again finds none.
    assert store.retry_dead("x1", record_effect) == "stored"
    assert store.dead_letters() == []
    assert store.retry_dead("x1", record_effect) is None
    assert count_effects(db_url, "x1") == 1


def test_retry_of_a_dead_letter_whose_effect_still_raises_keeps_it(store: ReceiptStore) -> None:
    consumer = Consumer(store, unsigned=True, effect=Refusing("r1"), max_deliveries=1, **AT_ONCE)
    assert consumer.consume_batch_now([message("r1")]) == ["dead"]
    with pytest.raises(RuntimeError):
        store.retry_dead("r1", Refusing("r1"))
    assert [row["reply_id"] for row in store.dead_letters()] == ["r1"]
    assert store.lookup("r1") is None


def test_purge_forgets_one_dead_letter_or_the_old_ones(db_url: str, store: ReceiptStore) -> None:
    consumer = Consumer(
        store, unsigned=True, effect=Refusing("q1", "q2"), max_deliveries=1, **AT_ONCE
    )
    assert consumer.consume_batch_now([message("q1"), message("q2")]) == ["dead", "dead"]
    assert store.purge_dead("q1") == 1
    assert store.purge_dead("q1") == 0
    engine = outbox.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE receiver_dead_letters SET dead_at = dead_at - 7200"))
    finally:
        engine.dispose()
    assert store.purge_dead(older_than=86_400) == 0
    assert store.purge_dead(older_than=3600) == 1
    assert store.dead_letters() == []


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_max_deliveries_must_be_a_whole_number_of_at_least_one(
    store: ReceiptStore, value: object
) -> None:
    with pytest.raises(ConfigError, match="max_deliveries"):
        Consumer(store, unsigned=True, max_deliveries=value)  # type: ignore[arg-type]


def test_last_tries_needs_isolate(store: ReceiptStore) -> None:
    last = {0: LastTry({}, 1)}
    with pytest.raises(ValueError, match="isolate"):
        store.accept_many([("l1", b"{}")], record_effect, last_tries=last)
    # An item on its last try whose effect passes is stored as any other.
    assert store.accept_many([("l1", b"{}")], record_effect, isolate=True, last_tries=last) == [
        "stored"
    ]
    assert store.dead_letters() == []


def test_a_message_is_tried_again_only_after_its_backoff(
    store: ReceiptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("receiver.consume._monotonic", lambda: now[0])
    consumer = Consumer(
        store, unsigned=True, effect=Refusing("b1"), max_deliveries=3, backoff=1, backoff_cap=8
    )
    assert consumer.consume_batch_now([message("b1")]) == ["retry"]
    # Delivered again at once, many times: held, its effect not run, nothing counted.
    for _ in range(10):
        assert consumer.consume_batch_now([message("b1", redelivered=True)]) == ["held"]
    now[0] += 1  # its backoff: 1 s after the first failure
    assert consumer.consume_batch_now([message("b1", redelivered=True)]) == ["retry"]
    now[0] += 1.9  # 2 s after the second
    assert consumer.consume_batch_now([message("b1", redelivered=True)]) == ["held"]
    now[0] += 0.1
    assert consumer.consume_batch_now([message("b1", redelivered=True)]) == ["dead"]
