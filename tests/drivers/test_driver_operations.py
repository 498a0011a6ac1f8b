"""Conformance: status counts, dead lists, requeue and resolve with their audit, purges, on
every registered driver."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, add_task, published, set_state, state_of

from outbox.dead_filter import DeadFilter
from outbox.drivers import Driver
from outbox.drivers.base import DeadOutcome


def dead(conn: sa.Connection, reply_id: str, status: int = 500, error: str = "boom") -> None:
    """A message the relay gave up on."""
    set_state(conn, reply_id, state="dead", attempts=7, last_status=status, last_error=error)


def test_counts_per_state_and_the_oldest_pending(driver: Driver, conn: sa.Connection) -> None:
    assert driver.state_counts(conn, "messages") == {}
    assert driver.oldest_pending_age(conn, "messages", START) is None
    for n in range(3):
        published(driver, conn, f"m-{n}", START - 100 + n * 10)
    set_state(conn, "m-0", state="sent")
    add_task(conn, "t-1", "pending", START - 40)
    add_task(conn, "t-2", "done", START - 400)
    assert driver.state_counts(conn, "messages") == {"pending": 2, "sent": 1}
    assert driver.state_counts(conn, "tasks") == {"pending": 1, "done": 1}
    assert driver.oldest_pending_age(conn, "messages", START) == 90.0
    assert driver.oldest_pending_age(conn, "tasks", START) == 40.0


def test_live_states_are_counted_each_zero_included(driver: Driver, conn: sa.Connection) -> None:
    for n in range(4):
        published(driver, conn, f"m-{n}", START)
    set_state(conn, "m-0", state="sent")
    set_state(conn, "m-1", state="dead")
    add_task(conn, "t-1", "running", START)
    assert driver.live_state_counts(conn, "messages") == {"pending": 2, "sending": 0, "dead": 1}
    assert driver.live_state_counts(conn, "tasks") == {"pending": 0, "running": 1}
    # Only PostgreSQL keeps statistics that say so (tests/console/test_console_plans.py
    # checks its estimates over an analyzed history).
    if driver.name != "postgresql":
        assert driver.state_estimates(conn, "messages") is None


def test_the_dead_list_filters_and_pages_in_id_order(driver: Driver, conn: sa.Connection) -> None:
    ids = {}
    for n, destination in enumerate(["a", "b", "a", "a"]):
        ids[n] = published(driver, conn, f"m-{n}", START - 100 * (4 - n), destination=destination)
    dead(conn, "m-0", 410, "Gone: the 100% OFF_sale")
    dead(conn, "m-1")
    dead(conn, "m-2", 503)
    # m-3 stays pending: never listed.
    listed = driver.dead_messages(conn, 10, START, DeadFilter())
    assert [row["reply_id"] for row in listed] == ["m-0", "m-1", "m-2"]
    assert listed[0]["id"] == ids[0]
    assert listed[0]["age"] == 400.0
    assert listed[0]["attempts"] == 7

    def chosen(**fields: object) -> list[str]:
        rows = driver.dead_messages(conn, 10, START, DeadFilter(**fields))  # type: ignore[arg-type]
        return [row["reply_id"] for row in rows]

    assert chosen(destination="a") == ["m-0", "m-2"]
    assert chosen(status=503) == ["m-2"]
    assert chosen(error="100% off_") == ["m-0"]  # case-insensitive, % and _ literal
    assert chosen(error="e%o") == []  # a wildcard would match "Gone: the 100% OFF"
    assert chosen(newer_than=350) == ["m-1", "m-2"]
    assert chosen(older_than=300) == ["m-0", "m-1"]
    assert chosen(after=ids[0]) == ["m-1", "m-2"]
    assert chosen(ids=(ids[1], ids[0], ids[3])) == ["m-0", "m-1"]  # m-3 is not dead
    assert chosen(destination="a", ids=(ids[1], ids[2])) == ["m-2"]
    assert chosen(ids=()) == []
    assert [r["reply_id"] for r in driver.dead_messages(conn, 1, START, DeadFilter())] == ["m-0"]


def test_a_delivery_record_has_the_body_and_its_size(driver: Driver, conn: sa.Connection) -> None:
    published(driver, conn, "m-1", START, body=b"\x00abc")
    record = driver.delivery_record(conn, "m-1")
    assert record is not None
    assert (record["state"], bytes(record["body"]), record["body_bytes"]) == (
        "pending",
        b"\x00abc",
        4,
    )
    assert driver.delivery_record(conn, "nobody") is None


def test_only_dead_messages_are_locked_for_a_decision(driver: Driver, conn: sa.Connection) -> None:
    first = published(driver, conn, "m-1", START - 100)
    second = published(driver, conn, "m-2", START - 100)
    published(driver, conn, "m-3", START - 100)  # pending: not dead
    dead(conn, "m-2", 404, "not found")
    dead(conn, "m-1", 500, "boom")
    locked = driver.lock_dead(conn, ["m-3", "m-2", "nobody", "m-1"])
    assert locked == {
        "m-1": DeadOutcome(first, 7, 500, "boom"),
        "m-2": DeadOutcome(second, 7, 404, "not found"),
    }
    assert driver.lock_dead(conn, []) == {}


def test_a_requeue_makes_dead_messages_pending_once(driver: Driver, conn: sa.Connection) -> None:
    ids = [published(driver, conn, f"m-{n}", START - 100) for n in range(3)]
    dead(conn, "m-0", 500, "boom")
    dead(conn, "m-1", 500, "boom")
    # m-2 is pending: the guard leaves it alone.
    assert driver.requeue_dead(conn, ids, START) == 2
    for reply_id in ("m-0", "m-1"):
        row = state_of(conn, reply_id)
        assert row is not None
        assert (row["state"], row["attempts"], row["available_at"]) == ("pending", 0, START)
        assert (row["last_status"], row["last_error"], row["owner"]) == (None, None, None)
    assert driver.requeue_dead(conn, ids, START) == 0  # no longer dead
    assert driver.requeue_dead(conn, [], START) == 0


def test_a_resolve_is_final_and_keeps_the_last_outcome(driver: Driver, conn: sa.Connection) -> None:
    message_id = published(driver, conn, "m-1", START - 100)
    assert driver.resolve_dead(conn, [message_id], START) == 0
    dead(conn, "m-1", 404, "not found")
    assert driver.resolve_dead(conn, [message_id], START) == 1
    row = state_of(conn, "m-1")
    assert row is not None
    assert (row["state"], row["resolved_at"]) == ("resolved", START)
    assert (row["attempts"], row["last_status"], row["last_error"]) == (7, 404, "not found")
    assert driver.resolve_dead(conn, [message_id], START + 1) == 0
    assert driver.message_state(conn, "m-1") == "resolved"
    assert driver.message_state(conn, "nobody") is None


def test_decision_audit_rows_come_back_whole_in_order(driver: Driver, conn: sa.Connection) -> None:
    values = {
        "action": "requeue",
        "reply_id": "m-1",
        "requested_by": "ops@example",
        "reason": "destination fixed",
        "receipt": "not received",
        "forced": False,
        "previous_attempts": 7,
        "previous_status": 500,
        "previous_error": "boom",
    }
    given = [values, values | {"reply_id": "m-0", "action": "resolve"}]
    first, second = driver.insert_decision_audits(conn, given, START)
    assert first == values | {"id": first["id"], "requested_at": START}
    assert (second["reply_id"], second["action"]) == ("m-0", "resolve")
    [third] = driver.insert_decision_audits(conn, [values | {"action": "resolve"}], START + 1)
    assert first["id"] < third["id"]
    assert [row["action"] for row in driver.decisions(conn, "m-1")] == ["requeue", "resolve"]
    assert driver.insert_decision_audits(conn, [], START) == []
    with pytest.raises(ValueError, match="each reply_id once"):
        driver.insert_decision_audits(conn, [values, values], START)


def test_a_batch_of_decisions_takes_a_few_statements_not_a_few_each(
    driver: Driver, conn: sa.Connection
) -> None:
    reply_ids = [f"m-{n}" for n in range(50)]
    ids = [published(driver, conn, reply_id, START - 100) for reply_id in reply_ids]
    for reply_id in reply_ids:
        dead(conn, reply_id)
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))

    inserts_before = mysql_inserts(conn) if driver.name == "mysql" else 0
    sa.event.listen(conn, "before_cursor_execute", count)
    try:
        locked = driver.lock_dead(conn, reply_ids)
        assert driver.requeue_dead(conn, ids, START) == 50
        audits = driver.insert_decision_audits(
            conn,
            [
                {
                    "action": "requeue",
                    "reply_id": reply_id,
                    "requested_by": "anna",
                    "reason": "r",
                    "receipt": "not received",
                    "forced": False,
                    "previous_attempts": locked[reply_id].attempts,
                    "previous_status": 500,
                    "previous_error": "boom",
                }
                for reply_id in reply_ids
            ],
            START,
        )
    finally:
        sa.event.remove(conn, "before_cursor_execute", count)
    assert [audit["reply_id"] for audit in audits] == reply_ids
    assert len({audit["id"] for audit in audits}) == 50
    # The lock, the update, the audits (and, where there is no RETURNING, their read-back
    # and the clock): never one per message.
    assert len(statements) <= 5, statements
    if driver.name == "mysql":
        # PyMySQL runs an executemany as one multi-row INSERT only when the statement
        # is plain VALUES: the server's own count says it was one.
        assert mysql_inserts(conn) - inserts_before == 1


def mysql_inserts(conn: sa.Connection) -> int:
    """The INSERT statements this MySQL session has run."""
    row = conn.exec_driver_sql("SHOW SESSION STATUS LIKE 'Com_insert'").one()
    return int(row[1])


def test_a_purge_deletes_old_sent_and_resolved_messages_only(
    driver: Driver, conn: sa.Connection
) -> None:
    for n in range(5):
        published(driver, conn, f"m-{n}", START - 1000)
    set_state(conn, "m-0", state="sent", sent_at=START - 500)
    set_state(conn, "m-1", state="resolved", resolved_at=START - 500)
    set_state(conn, "m-2", state="sent", sent_at=START - 10)  # young
    set_state(conn, "m-3", state="dead")  # never purged
    set_state(conn, "m-4", state="sent", sent_at=START - 600)
    assert driver.purge_messages(conn, START, 100, batch=2) == ["sent", "resolved"]
    assert driver.purge_messages(conn, START, 100, batch=2) == ["sent"]
    assert driver.purge_messages(conn, START, 100, batch=2) == []
    left = [f"m-{n}" for n in range(5) if state_of(conn, f"m-{n}") is not None]
    assert left == ["m-2", "m-3"]
