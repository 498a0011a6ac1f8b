"""Conformance: failed delivery attempts are recorded by the settle and the reap that end
them, read back for a reply's timeline, and purged with their message, on every driver."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from support.driver_helpers import START, published, set_state, state_of
from test_driver_relay import LEASE, claim, outcome

from outbox.drivers import Driver
from outbox.drivers.common.failed_attempts import LEASE_EXPIRED
from outbox.schema import failed_attempts

KEPT = ("attempt", "state", "status", "error", "attempted_at")


def attempts_of(driver: Driver, conn: sa.Connection, reply_id: str) -> list[tuple[Any, ...]]:
    """A message's failed attempts as the timeline reads them, oldest first."""
    stored = state_of(conn, reply_id)
    assert stored is not None
    return [tuple(row[k] for k in KEPT) for row in driver.failed_attempts(conn, stored["id"], 50)]


def test_a_settle_records_retries_and_deaths_and_nothing_for_a_delivery(
    driver: Driver, conn: sa.Connection
) -> None:
    for name in ("to-send", "to-retry", "to-kill"):
        published(driver, conn, name, START - 10)
    rows = {row.reply_id: row for row in claim(driver, conn)}
    outcomes = [
        outcome(rows["to-send"], "sent"),
        outcome(rows["to-retry"], "pending", status=503, error="busy", delay=7.5),
        outcome(rows["to-kill"], "dead", status=400, error="refused"),
    ]
    driver.settle(conn, "relay-1", outcomes, START + 1)
    assert attempts_of(driver, conn, "to-send") == []
    assert attempts_of(driver, conn, "to-retry") == [(1, "pending", 503, "busy", START + 1)]
    assert attempts_of(driver, conn, "to-kill") == [(1, "dead", 400, "refused", START + 1)]


def test_a_turn_of_deliveries_alone_writes_no_attempt_row(
    driver: Driver, conn: sa.Connection
) -> None:
    for n in range(3):
        published(driver, conn, f"m-{n}", START - 10)
    driver.settle(conn, "relay-1", [outcome(row, "sent") for row in claim(driver, conn)], START)
    assert conn.execute(sa.select(sa.func.count()).select_from(failed_attempts)).scalar() == 0


def test_each_attempt_is_a_row_of_its_own_numbered_by_the_messages_count(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "m-1", START - 10)
    for attempt in (1, 2):
        [row] = claim(driver, conn)
        assert row.attempts == attempt
        failure = outcome(row, "pending", status=500 + attempt, error=f"try {attempt}")
        # Due again at once (no delay), so the next claim at START takes it.
        driver.settle(conn, "relay-1", [failure], START - 3 + attempt)
    [row] = claim(driver, conn)
    driver.settle(conn, "relay-1", [outcome(row, "sent")], START)
    assert attempts_of(driver, conn, "m-1") == [
        (1, "pending", 501, "try 1", START - 2),
        (2, "pending", 502, "try 2", START - 1),
    ]


def test_an_unattempted_message_given_back_or_a_fenced_settle_records_nothing(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "given-back", START - 10)
    published(driver, conn, "fenced", START - 10)
    rows = {row.reply_id: row for row in claim(driver, conn)}
    back = outcome(rows["given-back"], "pending", status=None, error="not attempted", refund=1)
    stale = outcome(rows["fenced"], "dead", status=400, error="x", fence=rows["fenced"].fence - 1)
    assert driver.settle(conn, "relay-1", [back, stale], START + 1) == {rows["given-back"].id}
    assert attempts_of(driver, conn, "given-back") == []
    assert attempts_of(driver, conn, "fenced") == []


def test_a_reaped_lease_is_recorded_as_an_attempt_that_expired(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "m-1", START - 10)
    published(driver, conn, "m-2", START - 10)
    claim(driver, conn)
    assert driver.reap_expired_message_leases(conn, START + LEASE - 1, 10) == 0
    assert driver.reap_expired_message_leases(conn, START + LEASE, 10) == 2
    for name in ("m-1", "m-2"):
        assert attempts_of(driver, conn, name) == [
            (1, "pending", None, LEASE_EXPIRED, START + LEASE)
        ]


def test_the_newest_attempts_are_read_when_there_are_more_than_asked(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "m-1", START - 10)
    for attempt in (1, 2, 3):
        [row] = claim(driver, conn)
        driver.settle(conn, "relay-1", [outcome(row, "pending", error=str(attempt))], START)
    stored = state_of(conn, "m-1")
    assert stored is not None
    newest = driver.failed_attempts(conn, stored["id"], 2)
    assert [row["error"] for row in newest] == ["2", "3"]


def test_a_purged_messages_attempts_go_with_it(driver: Driver, conn: sa.Connection) -> None:
    published(driver, conn, "old", START - 1000)
    published(driver, conn, "kept", START - 1000)
    rows = {row.reply_id: row for row in claim(driver, conn)}
    failures = [outcome(row, "pending", status=503, error="busy") for row in rows.values()]
    driver.settle(conn, "relay-1", failures, START - 900)
    old, kept = state_of(conn, "old"), state_of(conn, "kept")
    assert old is not None
    assert kept is not None
    set_state(conn, "old", state="sent", sent_at=START - 600)
    assert driver.purge_messages(conn, START, 100, batch=10) == ["sent"]
    assert driver.failed_attempts(conn, old["id"], 50) == []
    assert len(driver.failed_attempts(conn, kept["id"], 50)) == 1
