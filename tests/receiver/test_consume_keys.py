"""A consumer keeps each ordering key's order across batches, whatever order the broker hands."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest
from support.broker_messages import delivery
from support.receiver_helpers import InOrder, count_effects, stored_receipts

from outbox.signing import CONTENT_HASH_HEADER
from receiver import ReceiptStore
from receiver.consume import Consumer
from receiver.deliveries import Delivery


def message(reply_id: str, key: str | None = None, *, spoiled: bool = False) -> Delivery:
    """A broker message as the relay publishes it, unsigned (spoiled: a wrong content hash)."""
    made = delivery(reply_id, key)
    if spoiled:
        return replace(made, headers={**made.headers, CONTENT_HASH_HEADER: "0" * 64})
    return made


def test_a_later_message_of_a_blocked_key_is_held_until_the_blocker_is_applied(
    db_url: str, store: ReceiptStore
) -> None:
    effect = InOrder("a2")
    # a2 may be tried again at once: this test is about order, not the backoff.
    consumer = Consumer(store, unsigned=True, effect=effect, backoff=1e-9, backoff_cap=1e-9)
    assert consumer.consume_batch_now([message("a1", "A"), message("a2", "A")]) == [
        "stored",
        "retry",
    ]
    # a3 comes before a2 is delivered again: it must wait, and B and the unkeyed must not.
    third = [message("a3", "A"), message("b1", "B"), message("u1")]
    assert consumer.consume_batch_now(third) == ["held", "stored", "stored"]
    assert consumer.consume_batch_now([message("a2", "A"), message("a3", "A")]) == ["retry", "held"]
    effect.failing.clear()
    assert consumer.consume_batch_now([message("a3", "A"), message("a2", "A")]) == [
        "held",
        "stored",
    ]
    assert consumer.consume_batch_now([message("a3", "A")]) == ["stored"]
    assert effect.out_of_order == []
    assert set(stored_receipts(db_url)) == {"a1", "a2", "a3", "b1", "u1"}
    assert count_effects(db_url) == 5


def test_an_invalid_message_under_the_blockers_id_does_not_release_its_key(
    store: ReceiptStore,
) -> None:
    effect = InOrder("c1")
    consumer = Consumer(store, unsigned=True, effect=effect, backoff=1e-9, backoff_cap=1e-9)
    assert consumer.consume_batch_now([message("c1", "C")]) == ["retry"]
    assert consumer.consume_batch_now([message("c2", "C")]) == ["held"]
    # Anyone may publish a damaged copy under c1's id: the real c1 passed the checks.
    assert consumer.consume_batch_now([message("c1", "C", spoiled=True)]) == ["invalid"]
    effect.failing.clear()
    assert consumer.consume_batch_now([message("c2", "C")]) == ["held"]
    # c2 in c1's own batch was checked against the block before c1 was stored: held once.
    assert consumer.consume_batch_now([message("c1", "C"), message("c2", "C")]) == [
        "stored",
        "held",
    ]
    assert consumer.consume_batch_now([message("c2", "C")]) == ["stored"]


def test_a_message_held_beside_its_stored_blocker_keeps_its_key_blocked(
    store: ReceiptStore,
) -> None:
    effect = InOrder("a2")
    consumer = Consumer(store, unsigned=True, effect=effect, backoff=1e-9, backoff_cap=1e-9)
    first = [message("a1", "A"), message("a2", "A"), message("a3", "A")]
    assert consumer.consume_batch_now(first) == ["stored", "retry", "held"]
    assert consumer.consume_batch_now([message("a4", "A")]) == ["held"]
    effect.failing.clear()
    # a3 was checked against the block before a2 was stored: held, and given back to the
    # broker behind a4, which the broker may then hand over first.
    assert consumer.consume_batch_now([message("a2", "A"), message("a3", "A")]) == [
        "stored",
        "held",
    ]
    assert consumer.consume_batch_now([message("a4", "A")]) == ["held"]
    assert consumer.consume_batch_now([message("a3", "A")]) == ["stored"]
    assert consumer.consume_batch_now([message("a4", "A")]) == ["stored"]
    assert effect.out_of_order == []


def test_a_later_message_stored_beside_the_blocker_waits_for_the_one_given_back_before_it(
    store: ReceiptStore,
) -> None:
    effect = InOrder("a2")
    consumer = Consumer(store, unsigned=True, effect=effect, backoff=1e-9, backoff_cap=1e-9)
    assert consumer.consume_batch_now([message("a1", "A"), message("a2", "A")]) == [
        "stored",
        "retry",
    ]
    assert consumer.consume_batch_now([message("a3", "A")]) == ["held"]
    effect.failing.clear()
    # The broker hands a4 over with a2 before a3 comes back: a3, given back first, is next.
    assert consumer.consume_batch_now([message("a2", "A"), message("a4", "A")]) == [
        "stored",
        "held",
    ]
    assert consumer.consume_batch_now([message("a4", "A")]) == ["held"]
    assert consumer.consume_batch_now([message("a3", "A")]) == ["stored"]
    assert consumer.consume_batch_now([message("a4", "A")]) == ["stored"]
    assert effect.out_of_order == []


def test_a_blocker_settled_in_a_batch_without_its_keys_next_message_passes_the_block_on(
    store: ReceiptStore,
) -> None:
    effect = InOrder("a2")
    consumer = Consumer(store, unsigned=True, effect=effect, backoff=1e-9, backoff_cap=1e-9)
    assert consumer.consume_batch_now([message("a1", "A"), message("a2", "A")]) == [
        "stored",
        "retry",
    ]
    assert consumer.consume_batch_now([message("a3", "A"), message("a4", "A")]) == ["held"] * 2
    effect.failing.clear()
    assert consumer.consume_batch_now([message("a2", "A")]) == ["stored"]
    assert consumer.consume_batch_now([message("a4", "A")]) == ["held"]
    assert consumer.consume_batch_now([message("a3", "A"), message("a4", "A")]) == [
        "stored",
        "held",
    ]
    assert consumer.consume_batch_now([message("a4", "A")]) == ["stored"]
    assert effect.out_of_order == []


def test_a_blocker_that_does_not_come_back_releases_its_key_after_key_hold(
    store: ReceiptStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr("receiver.consume._monotonic", lambda: now[0])
    consumer = Consumer(store, unsigned=True, effect=InOrder("d1"), key_hold=60)
    assert consumer.consume_batch_now([message("d1", "D")]) == ["retry"]
    now[0] += 59
    assert consumer.consume_batch_now([message("d2", "D")]) == ["held"]
    now[0] += 2
    with caplog.at_level(logging.WARNING, "outbox.receiver.consume"):
        assert consumer.consume_batch_now([message("d2", "D")]) == ["stored"]
    assert any("d1" in r.getMessage() for r in caplog.records)


def test_after_a_blocker_that_does_not_come_back_the_next_message_seen_since_blocks_its_key(
    store: ReceiptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("receiver.consume._monotonic", lambda: now[0])
    effect = InOrder("d1")
    consumer = Consumer(store, unsigned=True, effect=effect, key_hold=60)
    assert consumer.consume_batch_now([message("d1", "D")]) == ["retry"]
    now[0] = 1040.0
    assert consumer.consume_batch_now([message("d2", "D"), message("d3", "D")]) == ["held"] * 2
    now[0] = 1061.0  # d1 is given up; d2, given back 21 s ago, is waited for
    assert consumer.consume_batch_now([message("d3", "D")]) == ["held"]
    assert consumer.consume_batch_now([message("d2", "D")]) == ["stored"]
    assert consumer.consume_batch_now([message("d3", "D")]) == ["stored"]
    assert effect.out_of_order == ["d2"]  # applied without d1, which never came back


def test_a_message_held_for_its_backoff_holds_its_keys_later_ones_in_the_same_batch(
    store: ReceiptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("receiver.consume._monotonic", lambda: now[0])
    effect = InOrder("e1")
    consumer = Consumer(store, unsigned=True, effect=effect, key_hold=1, backoff=5, backoff_cap=5)
    assert consumer.consume_batch_now([message("e1", "E")]) == ["retry"]
    effect.failing.clear()
    now[0] = 1002.0  # the block expired; e1's backoff has not
    assert consumer.consume_batch_now([message("e1", "E"), message("e2", "E")]) == ["held"] * 2
    now[0] = 1006.0
    assert consumer.consume_batch_now([message("e1", "E")]) == ["stored"]
    assert consumer.consume_batch_now([message("e2", "E")]) == ["stored"]
    assert effect.out_of_order == []


def test_the_block_lasts_key_hold_from_the_last_failure(
    store: ReceiptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("receiver.consume._monotonic", lambda: now[0])
    consumer = Consumer(store, unsigned=True, effect=InOrder("e1"), key_hold=60)
    for _ in range(3):  # it keeps coming back and failing: the key stays blocked
        assert consumer.consume_batch_now([message("e1", "E")]) == ["retry"]
        now[0] += 50
    assert consumer.consume_batch_now([message("e2", "E")]) == ["held"]


def test_a_malformed_ordering_key_header_is_invalid(store: ReceiptStore) -> None:
    consumer = Consumer(store, unsigned=True)
    assert consumer.consume_batch_now([message("f1", ""), message("f2", "é")]) == ["invalid"] * 2


def test_a_message_that_keeps_failing_does_not_slow_the_other_keys(
    store: ReceiptStore,
) -> None:
    consumer = Consumer(store, unsigned=True, effect=InOrder("g1"), backoff=1, backoff_cap=8)

    async def scenario() -> None:
        await consumer.consume_batch([message("g1", "G"), message("h1", "H")])
        assert consumer.retry_delay() == 0
        # Nothing but the failing key: now the consumer pauses, doubling.
        await consumer.consume_batch([message("g1", "G"), message("g2", "G")])
        assert consumer.retry_delay() == 1
        await consumer.consume_batch([message("g1", "G")])
        assert consumer.retry_delay() == 2

    asyncio.run(scenario())
