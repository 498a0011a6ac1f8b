"""Conformance: a held task's guarded transitions (fail, release, cancel) and its row, on
every driver."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from support.driver_helpers import START
from support.task_rows import task_values

from outbox.drivers import Driver

HELD = ("t", "w", 1)
RUNNING = {"state": "running", "owner": "w", "fence": 1, "attempts": 1, "lease_until": START + 30}


def held_task(driver: Driver, conn: sa.Connection, **more: Any) -> None:
    """Task "t", running under owner "w" and fence 1 until START + 30."""
    driver.insert_task(conn, task_values("t", **(RUNNING | more)))


def row(driver: Driver, conn: sa.Connection) -> dict[str, Any]:
    """Task "t"'s row."""
    found = driver.task_row(conn, "t")
    assert found is not None
    return dict(found)


def test_a_failed_task_goes_back_to_pending_after_its_delay(
    driver: Driver, conn: sa.Connection
) -> None:
    held_task(driver, conn)
    state = driver.fail_task(conn, HELD, START + 10, reason="boom", permanent=False, delay=7.0)
    assert state == "pending"
    found = row(driver, conn)
    assert (found["available_at"], found["lease_until"], found["last_error"]) == (
        START + 17,
        None,
        "boom",
    )


def test_a_task_fails_for_good_when_permanent_or_out_of_attempts(
    driver: Driver, conn: sa.Connection
) -> None:
    held_task(driver, conn)
    assert driver.fail_task(conn, HELD, START + 10, reason="no", permanent=True, delay=1.0) == (
        "failed"
    )
    assert row(driver, conn)["finished_at"] == START + 10
    driver.insert_task(conn, task_values("spent", **(RUNNING | {"attempts": 3})))
    spent = ("spent", "w", 1)
    assert driver.fail_task(conn, spent, START + 10, reason="x", permanent=False, delay=1.0) == (
        "failed"
    )


def test_a_transition_of_a_task_not_held_changes_nothing(
    driver: Driver, conn: sa.Connection
) -> None:
    held_task(driver, conn)
    stale, lapsed = ("t", "w", 2), START + 31
    assert driver.fail_task(conn, stale, START + 10, reason="x", permanent=False, delay=1) is None
    assert driver.fail_task(conn, HELD, lapsed, reason="x", permanent=False, delay=1) is None
    assert driver.release_task(conn, ("t", "other", 1), START + 10) is False
    assert row(driver, conn)["state"] == "running"


def test_a_released_task_is_due_at_once_its_attempt_returned(
    driver: Driver, conn: sa.Connection
) -> None:
    held_task(driver, conn)
    assert driver.release_task(conn, HELD, START + 10) is True
    found = row(driver, conn)
    assert (found["state"], found["attempts"], found["available_at"]) == ("pending", 0, START + 10)


def test_a_pending_or_running_task_is_cancelled_once(driver: Driver, conn: sa.Connection) -> None:
    held_task(driver, conn)
    assert driver.cancel_task(conn, "t", "stop", START + 10) is True
    found = row(driver, conn)
    assert (found["state"], found["last_error"], found["finished_at"]) == (
        "cancelled",
        "stop",
        START + 10,
    )
    assert driver.cancel_task(conn, "t", "again", START + 11) is False
    assert driver.cancel_task(conn, "missing", "stop", START + 11) is False
    assert driver.task_row(conn, "missing") is None
