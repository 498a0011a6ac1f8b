"""Conformance: what the console reads, on every registered driver."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, add_task, published, set_state

from outbox.drivers import Driver

MINUTE = 60.0


def test_a_task_and_the_reply_it_wrote(driver: Driver, conn: sa.Connection) -> None:
    add_task(conn, "t-1", "done", START)
    assert driver.reply_of(conn, "t-1") is None
    published(driver, conn, "reply:t-1", START, task_id="t-1")
    task = driver.task(conn, "t-1")
    assert task is not None
    assert (task["task_id"], task["state"], task["payload"]) == ("t-1", "done", '{"job":1}')
    assert driver.reply_of(conn, "t-1") == {"reply_id": "reply:t-1", "state": "pending"}
    assert driver.task(conn, "nobody") is None


def test_a_message_exists_by_its_reply_id(driver: Driver, conn: sa.Connection) -> None:
    assert not driver.message_exists(conn, "m-1")
    published(driver, conn, "m-1", START)
    assert driver.message_exists(conn, "m-1")


def test_the_charts_count_each_minute_of_their_window(driver: Driver, conn: sa.Connection) -> None:
    base = 1000 * MINUTE
    for n, at in enumerate([base + 1, base + 59, base + MINUTE + 5, base + 3 * MINUTE]):
        published(driver, conn, f"m-{n}", at)
    set_state(conn, "m-0", state="sent", sent_at=base + 2 * MINUTE + 1)
    set_state(conn, "m-1", state="dead")
    add_task(conn, "t-1", "done", base)  # finished a second later
    window = (base, base + 3 * MINUTE)  # the last message's minute is outside it
    assert driver.per_minute(conn, "enqueued", *window) == {1000: 2, 1001: 1}
    assert driver.per_minute(conn, "sent", *window) == {1002: 1}
    assert driver.per_minute(conn, "dead", *window) == {1000: 1}
    assert driver.per_minute(conn, "finished", *window) == {1000: 1}
    assert driver.per_minute(conn, "enqueued", base + 10 * MINUTE, base + 11 * MINUTE) == {}


def test_a_destinations_charts_count_its_own_messages(driver: Driver, conn: sa.Connection) -> None:
    base = 1000 * MINUTE
    for n, destination in enumerate(["a", "b", "a"]):
        published(driver, conn, f"m-{n}", base + n, destination=destination)
    set_state(conn, "m-0", state="sent", sent_at=base + 5)
    set_state(conn, "m-1", state="sent", sent_at=base + 5)
    set_state(conn, "m-2", state="dead")
    window = (base, base + MINUTE)
    assert driver.per_minute(conn, "enqueued", *window, "a") == {1000: 2}
    assert driver.per_minute(conn, "sent", *window, "b") == {1000: 1}
    assert driver.per_minute(conn, "dead", *window, "b") == {}
    assert driver.per_minute(conn, "dead", *window, "a") == {1000: 1}
    with pytest.raises(ValueError, match="finished has no destination"):
        driver.per_minute(conn, "finished", *window, "a")


def test_dead_since_counts_each_destinations_messages_that_died_in_the_window(
    driver: Driver, conn: sa.Connection
) -> None:
    for reply_id, destination, died in (
        ("o-old", "orders", START - 3700),
        ("o-1", "orders", START - 100),
        ("o-2", "orders", START - 10),
        ("b-1", "billing", START - 3000),
    ):
        published(driver, conn, reply_id, START - 4000, destination=destination)
        set_state(conn, reply_id, state="dead", available_at=died)
    published(driver, conn, "pending", START - 50)
    published(driver, conn, "sent", START - 50)
    set_state(conn, "sent", state="sent", available_at=START - 50)
    assert driver.dead_since(conn, START - 3600) == {"orders": 2, "billing": 1}
    assert driver.dead_since(conn, START - 60) == {"orders": 1}
    assert driver.dead_since(conn, START) == {}


def test_the_audit_is_read_newest_first_by_page_and_operator(
    driver: Driver, conn: sa.Connection
) -> None:
    for n, by in enumerate(["anna", "bob", "anna", "anna"]):
        driver.insert_decision_audits(
            conn,
            [
                {
                    "action": "resolve",
                    "reply_id": f"m-{n}",
                    "requested_by": by,
                    "reason": "why",
                    "receipt": "not checked",
                    "forced": False,
                    "previous_attempts": 3,
                    "previous_status": None,
                    "previous_error": None,
                }
            ],
            START + n,
        )

    def page(limit: int, before: int | None = None, by: str | None = None) -> list[str]:
        return [row["reply_id"] for row in driver.audit_page(conn, limit, before, by)]

    assert page(10) == ["m-3", "m-2", "m-1", "m-0"]
    assert page(2) == ["m-3", "m-2"]
    newest = driver.audit_page(conn, 1, None, None)[0]
    assert newest["requested_at"] == START + 3
    assert page(10, before=newest["id"]) == ["m-2", "m-1", "m-0"]
    assert page(10, by="anna") == ["m-3", "m-2", "m-0"]
    assert page(1, before=newest["id"], by="anna") == ["m-2"]
    assert page(10, by="nobody") == []
