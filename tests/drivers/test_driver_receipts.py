"""Conformance: receipts, reference effects and dead letters, on every registered driver."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from support.driver_helpers import START

from outbox.canonical import sha256_hex
from outbox.drivers import Driver
from outbox.drivers.base import HeldReceipt
from outbox.receiver_tables import effects

BODY = b'{"order":1}'
OTHER = b'{"order":2}'


def accept(
    driver: Driver, conn: sa.Connection, reply_id: str, body: bytes, now: float | None
) -> dict[str, float]:
    """One receipt through the driver."""
    return driver.insert_receipts(conn, [reply_id], [sha256_hex(body)], [body], now)


def effect_rows(conn: sa.Connection) -> list[tuple[str, float, bytes]]:
    """The reference effect's rows, oldest first."""
    rows = conn.execute(sa.select(effects.c.reply_id, effects.c.created_at, effects.c.body))
    return sorted((r, float(at), bytes(body)) for r, at, body in rows)


def test_a_new_receipt_is_stored_at_the_time_given(driver: Driver, conn: sa.Connection) -> None:
    assert accept(driver, conn, "r-1", BODY, START) == {"r-1": START}
    assert driver.receipt(conn, "r-1") == HeldReceipt("r-1", sha256_hex(BODY), START)
    assert driver.receipt_body(conn, "r-1") == BODY


def test_without_a_time_the_database_clock_stamps_the_receipt(
    driver: Driver, conn: sa.Connection
) -> None:
    before = time.time()
    [(_, received_at)] = accept(driver, conn, "r-1", BODY, None).items()
    assert before - 5 <= received_at <= time.time() + 5


def test_the_same_body_again_is_held_not_inserted(driver: Driver, conn: sa.Connection) -> None:
    accept(driver, conn, "r-1", BODY, START)
    assert accept(driver, conn, "r-1", BODY, START + 10) == {}
    assert driver.held_receipts(conn, ["r-1"]) == [HeldReceipt("r-1", sha256_hex(BODY), START)]


def test_another_body_keeps_the_first_one(driver: Driver, conn: sa.Connection) -> None:
    accept(driver, conn, "r-1", BODY, START)
    assert accept(driver, conn, "r-1", OTHER, START + 10) == {}
    assert driver.receipt(conn, "r-1") == HeldReceipt("r-1", sha256_hex(BODY), START)
    assert driver.receipt_body(conn, "r-1") == BODY


def test_a_batch_inserts_only_its_new_receipts(driver: Driver, conn: sa.Connection) -> None:
    accept(driver, conn, "held", BODY, START)
    ids, bodies = ["new-1", "held", "new-2"], [BODY, BODY, OTHER]
    inserted = driver.insert_receipts(conn, ids, [sha256_hex(b) for b in bodies], bodies, START + 1)
    assert inserted == {"new-1": START + 1, "new-2": START + 1}
    held = sorted(driver.held_receipts(conn, ids))
    assert [h.reply_id for h in held] == ["held", "new-1", "new-2"]
    assert driver.receipt_body(conn, "new-2") == OTHER


def test_lookups_of_an_unknown_reply_id_find_nothing(driver: Driver, conn: sa.Connection) -> None:
    assert driver.receipt(conn, "nobody") is None
    assert driver.receipt_body(conn, "nobody") is None
    assert driver.held_receipts(conn, ["nobody"]) == []


def test_reference_effects_are_written_with_their_receipts(
    driver: Driver, conn: sa.Connection
) -> None:
    driver.insert_effects(conn, [("r-1", START, BODY), ("r-2", START + 1, OTHER)])
    assert effect_rows(conn) == [("r-1", START, BODY), ("r-2", START + 1, OTHER)]


def test_a_fused_insert_writes_the_effects_of_first_receipts_only(
    driver: Driver, conn: sa.Connection
) -> None:
    if not driver.fuses_reference_effect:
        with pytest.raises(ValueError, match="apart"):
            driver.insert_receipts(
                conn, ["r-1"], [sha256_hex(BODY)], [BODY], START, with_reference_effect=True
            )
        return
    accept(driver, conn, "held", BODY, START)
    ids, bodies = ["held", "new"], [BODY, OTHER]
    inserted = driver.insert_receipts(
        conn, ids, [sha256_hex(b) for b in bodies], bodies, START + 1, with_reference_effect=True
    )
    assert inserted == {"new": START + 1}
    assert effect_rows(conn) == [("new", START + 1, OTHER)]


def test_a_purge_deletes_the_old_receipts_oldest_first_and_keeps_the_young(
    driver: Driver, conn: sa.Connection
) -> None:
    for n, at in enumerate([START - 300, START - 200, START - 100, START - 10]):
        accept(driver, conn, f"r-{n}", BODY, at)
    assert driver.purge_receipts(conn, START, 50, batch=2) == 2
    assert driver.receipt(conn, "r-0") is None
    assert driver.receipt(conn, "r-1") is None
    assert driver.receipt(conn, "r-2") is not None
    assert driver.purge_receipts(conn, START, 50, batch=2) == 1
    assert driver.receipt(conn, "r-2") is None
    assert driver.receipt(conn, "r-3") is not None
    assert driver.purge_receipts(conn, START, 50, batch=2) == 0


def dead_row(reply_id: str, reason: str = "KeyError: 'sku'") -> dict[str, object]:
    """A dead letter as the receipt store writes it."""
    return {
        "reply_id": reply_id,
        "content_hash": sha256_hex(BODY),
        "body": BODY,
        "headers": '{"x-trace":"1"}',
        "reason": reason,
        "failures": 3,
        "deliveries": 4,
        "broker": "nats",
        "broker_ref": "ORDERS:17",
    }


def test_a_dead_letter_is_kept_once_listed_and_forgotten(
    driver: Driver, conn: sa.Connection
) -> None:
    driver.insert_dead_letter(conn, dead_row("d-2"), START + 1)
    driver.insert_dead_letter(conn, dead_row("d-1"), START)
    driver.insert_dead_letter(conn, dead_row("d-1", reason="another copy"), START + 5)
    listed = driver.dead_letters(conn, limit=10)
    assert [letter["reply_id"] for letter in listed] == ["d-1", "d-2"]
    assert listed[0] == {
        "reply_id": "d-1",
        "reason": "KeyError: 'sku'",
        "failures": 3,
        "deliveries": 4,
        "broker": "nats",
        "dead_at": START,
    }
    assert [letter["reply_id"] for letter in driver.dead_letters(conn, limit=1)] == ["d-1"]
    whole = driver.dead_letter(conn, "d-2")
    assert whole is not None
    assert bytes(whole["body"]) == BODY
    assert whole["broker_ref"] == "ORDERS:17"
    assert driver.dead_among(conn, ["d-1", "alive", "d-2"]) == {"d-1", "d-2"}
    assert driver.delete_dead_letter(conn, "d-1") == 1
    assert driver.delete_dead_letter(conn, "d-1") == 0
    assert driver.dead_letter(conn, "d-1") is None


def test_dead_letters_older_than_an_age_are_forgotten(driver: Driver, conn: sa.Connection) -> None:
    driver.insert_dead_letter(conn, dead_row("old"), START - 100)
    driver.insert_dead_letter(conn, dead_row("young"), START - 10)
    assert driver.delete_dead_letters_before(conn, START, 50) == 1
    assert driver.dead_among(conn, ["old", "young"]) == {"young"}
