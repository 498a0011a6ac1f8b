"""Conformance: publish and the reads of messages, on every registered driver."""

from __future__ import annotations

import sqlalchemy as sa
from support.driver_helpers import START, announce, message_row, published, set_state

from outbox.drivers import Driver
from outbox.drivers.base import Unrouted

BODIES = [b'{"a":"\xc3\xa9"}', b"\x00\xff\x80 not json", b"", b"[" * 1000 + b"]" * 1000]
"""Bodies whose exact bytes must come back: UTF-8, binary, empty, long."""


def test_a_message_is_published_pending_and_due_now(driver: Driver, conn: sa.Connection) -> None:
    row = driver.insert_message(conn, message_row("m-1", ordering_key="k"), START)
    assert row is not None
    assert row["reply_id"] == "m-1"
    assert bytes(row["body"]) == b'{"n":1}'
    assert (row["state"], row["attempts"], row["fence"]) == ("pending", 0, 0)
    assert (row["available_at"], row["created_at"]) == (START, START)
    assert row["ordering_key"] == "k"
    again = driver.message(conn, "m-1")
    assert again is not None
    assert dict(again) == dict(row)


def test_publishing_a_reply_id_again_inserts_nothing(driver: Driver, conn: sa.Connection) -> None:
    published(driver, conn, "m-1", START)
    assert driver.insert_message(conn, message_row("m-1", body=b"other"), START + 5) is None
    kept = driver.message(conn, "m-1")
    assert kept is not None
    assert bytes(kept["body"]) == b'{"n":1}'
    assert kept["created_at"] == START


def test_many_messages_keep_their_exact_bytes_in_order(driver: Driver, conn: sa.Connection) -> None:
    ids = [published(driver, conn, f"m-{n}", START + n, body=body) for n, body in enumerate(BODIES)]
    assert ids == sorted(ids)
    for n, body in enumerate(BODIES):
        row = driver.message(conn, f"m-{n}")
        assert row is not None
        assert bytes(row["body"]) == body


def test_an_unknown_reply_id_reads_as_none(driver: Driver, conn: sa.Connection) -> None:
    assert driver.message(conn, "nobody") is None


def test_pending_messages_no_live_relay_announces_are_unrouted(
    driver: Driver, conn: sa.Connection
) -> None:
    assert driver.unrouted(conn, START) == Unrouted(0, None)
    published(driver, conn, "m-1", START - 30, destination="orders")
    published(driver, conn, "m-2", START - 20, destination="billing")
    published(driver, conn, "m-3", START - 90, destination="billing")
    set_state(conn, "m-3", state="sent")
    announce(conn, "orders", expires_at=START + 60)
    announce(conn, "billing", expires_at=START - 1)  # expired: no longer routes
    assert driver.unrouted(conn, START) == Unrouted(1, 20.0)


def test_messages_are_read_in_sequence_order_by_state_and_limit(
    driver: Driver, conn: sa.Connection
) -> None:
    ids = [published(driver, conn, f"r-{n}", START) for n in range(4)]
    set_state(conn, "r-1", state="sent")
    assert [row["id"] for row in driver.messages_in_order(conn, None, None)] == ids
    pending = driver.messages_in_order(conn, "pending", None)
    assert [row["reply_id"] for row in pending] == ["r-0", "r-2", "r-3"]
    assert [row["id"] for row in driver.messages_in_order(conn, "pending", 2)] == [ids[0], ids[2]]
    assert driver.messages_in_order(conn, "dead", None) == []
