"""Conformance: failed delivery attempts are recorded by the settle and the reap that end
them, read back for a reply's timeline, and purged with their message, on every driver."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from support.driver_helpers import START, published, set_state, state_of
from test_driver_relay import LEASE, claim, outcome

from outbox.drivers import Driver
from outbox.drivers.common.failed_attempts import LEASE_EXPIRED
from outbox.drivers.records import ClaimedRow, FailedAttempt, Settlement
from outbox.schema import failed_attempts

KEPT = ("attempt", "state", "status", "error", "attempted_at")


def failure(row: ClaimedRow, settled: Settlement) -> FailedAttempt:
    """The failed attempt a relay names for a claimed row whose attempt did not deliver."""
    return FailedAttempt(row.id, row.attempts, settled.state, settled.status, settled.error)


def attempts_of(driver: Driver, conn: sa.Connection, reply_id: str) -> list[tuple[Any, ...]]:
    """A message's failed attempts as the timeline reads them, oldest first."""
    stored = state_of(conn, reply_id)
    assert stored is not None
    return [
        tuple(row[k] for k in KEPT)
        for row in driver.failed_attempts(conn, stored["id"], 50, stored["created_at"])
    ]


def test_a_settle_records_the_turns_failed_attempts_and_nothing_for_a_delivery(
    driver: Driver, conn: sa.Connection
) -> None:
    for name in ("to-send", "to-retry", "to-kill"):
        published(driver, conn, name, START - 10)
    rows = {row.reply_id: row for row in claim(driver, conn)}
    retried = outcome(rows["to-retry"], "pending", status=503, error="busy", delay=7.5)
    killed = outcome(rows["to-kill"], "dead", status=400, error="refused")
    outcomes = [outcome(rows["to-send"], "sent"), retried, killed]
    failures = [failure(rows["to-retry"], retried), failure(rows["to-kill"], killed)]
    driver.settle(conn, "relay-1", outcomes, START + 1, failures)
    assert attempts_of(driver, conn, "to-send") == []
    assert attempts_of(driver, conn, "to-retry") == [(1, "pending", 503, "busy", START + 1)]
    assert attempts_of(driver, conn, "to-kill") == [(1, "dead", 400, "refused", START + 1)]


def test_an_attempts_answer_is_recorded_though_a_lookup_then_settled_it_otherwise(
    driver: Driver, conn: sa.Connection
) -> None:
    # The attempt failed (503), its budget was spent, and the receipt lookup found the
    # delivery: the message settles sent, the attempt keeps its own answer.
    published(driver, conn, "m-1", START - 10)
    [row] = claim(driver, conn)
    answered = FailedAttempt(row.id, row.attempts, "pending", 503, "busy")
    driver.settle(conn, "relay-1", [outcome(row, "sent")], START + 1, [answered])
    assert attempts_of(driver, conn, "m-1") == [(1, "pending", 503, "busy", START + 1)]


def test_a_settle_without_failures_writes_no_attempt_row(
    driver: Driver, conn: sa.Connection
) -> None:
    for n in range(3):
        published(driver, conn, f"m-{n}", START - 10)
    rows = claim(driver, conn)
    # A refunded retry and a retry the relay names no failure for: nothing recorded.
    back = outcome(rows[0], "pending", status=None, error="not attempted", refund=1)
    driver.settle(
        conn, "relay-1", [back, outcome(rows[1], "pending"), outcome(rows[2], "sent")], START
    )
    assert conn.execute(sa.select(sa.func.count()).select_from(failed_attempts)).scalar() == 0


def test_each_attempt_is_a_row_of_its_own_numbered_by_the_messages_count(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "m-1", START - 10)
    for attempt in (1, 2):
        [row] = claim(driver, conn)
        assert row.attempts == attempt
        failed = outcome(row, "pending", status=500 + attempt, error=f"try {attempt}")
        # Due again at once (no delay), so the next claim at START takes it.
        driver.settle(conn, "relay-1", [failed], START - 3 + attempt, [failure(row, failed)])
    [row] = claim(driver, conn)
    driver.settle(conn, "relay-1", [outcome(row, "sent")], START)
    assert attempts_of(driver, conn, "m-1") == [
        (1, "pending", 501, "try 1", START - 2),
        (2, "pending", 502, "try 2", START - 1),
    ]


def test_a_fenced_settle_records_nothing(driver: Driver, conn: sa.Connection) -> None:
    published(driver, conn, "fenced", START - 10)
    [row] = claim(driver, conn)
    stale = outcome(row, "dead", status=400, error="x", fence=row.fence - 1)
    assert driver.settle(conn, "relay-1", [stale], START + 1, [failure(row, stale)]) == set()
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
        failed = outcome(row, "pending", error=str(attempt))
        driver.settle(conn, "relay-1", [failed], START, [failure(row, failed)])
    stored = state_of(conn, "m-1")
    assert stored is not None
    newest = driver.failed_attempts(conn, stored["id"], 2, stored["created_at"])
    assert [row["error"] for row in newest] == ["2", "3"]


def test_a_purged_messages_attempts_go_with_it(driver: Driver, conn: sa.Connection) -> None:
    published(driver, conn, "old", START - 1000)
    published(driver, conn, "kept", START - 1000)
    rows = claim(driver, conn)
    failed = [outcome(row, "pending", status=503, error="busy") for row in rows]
    driver.settle(
        conn,
        "relay-1",
        failed,
        START - 900,
        [failure(r, f) for r, f in zip(rows, failed, strict=True)],
    )
    old, kept = state_of(conn, "old"), state_of(conn, "kept")
    assert old is not None
    assert kept is not None
    set_state(conn, "old", state="sent", sent_at=START - 600)
    assert driver.purge_messages(conn, START, 100, batch=10) == ["sent"]
    assert driver.failed_attempts(conn, old["id"], 50, old["created_at"]) == []
    assert len(driver.failed_attempts(conn, kept["id"], 50, kept["created_at"])) == 1


def test_attempts_older_than_the_message_are_not_its(driver: Driver, conn: sa.Connection) -> None:
    # Left by an earlier message under the same id (deleted by plain SQL, its attempts
    # kept): not shown in this one's timeline.
    published(driver, conn, "m-1", START - 10)
    stored = state_of(conn, "m-1")
    assert stored is not None
    conn.execute(
        sa.insert(failed_attempts).values(
            message_id=stored["id"], attempt=1, state="dead", status=410, error="earlier",
            attempted_at=stored["created_at"] - 1,
        )
    )  # fmt: skip
    assert driver.failed_attempts(conn, stored["id"], 50, stored["created_at"]) == []
