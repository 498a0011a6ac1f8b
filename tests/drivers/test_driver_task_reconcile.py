"""Conformance: reconciling tasks (deadlines passed, leases expired), on every driver."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from support.driver_helpers import START
from support.task_rows import task_values

from outbox.drivers import Driver
from outbox.drivers.task_interface import EndedTask
from outbox.schema import tasks


def stored(driver: Driver, conn: sa.Connection, task_id: str, **more: Any) -> None:
    """A task row with these columns changed from a pending task's."""
    driver.insert_task(conn, task_values(task_id, **more))


def states(conn: sa.Connection) -> dict[str, tuple[str, Any]]:
    """Each task's state and available_at."""
    rows = conn.execute(sa.select(tasks.c.task_id, tasks.c.state, tasks.c.available_at))
    return {task_id: (state, available) for task_id, state, available in rows}


def test_tasks_past_their_deadline_expire(driver: Driver, conn: sa.Connection) -> None:
    stored(driver, conn, "late-pending", deadline=START + 10)
    running = {"state": "running", "owner": "w", "lease_until": START + 100, "attempts": 1}
    stored(driver, conn, "late-running", deadline=START + 10, **running)
    stored(driver, conn, "in-time", deadline=START + 30)
    stored(driver, conn, "late-done", deadline=START + 10, state="done", finished_at=START)
    ended = driver.expire_past_deadline(conn, START + 20, 10)
    assert sorted(ended) == [
        EndedTask("late-pending", "expired", "deadline passed"),
        EndedTask("late-running", "expired", "deadline passed"),
    ]
    found = states(conn)
    assert found["in-time"][0] == "pending"
    assert found["late-done"][0] == "done"
    assert found["late-running"][0] == "expired"


def test_expiring_stops_at_its_limit(driver: Driver, conn: sa.Connection) -> None:
    for n in range(5):
        stored(driver, conn, f"t-{n}", deadline=START + 10)
    assert len(driver.expire_past_deadline(conn, START + 20, 3)) == 3
    assert len(driver.expire_past_deadline(conn, START + 20, 3)) == 2
    assert driver.expire_past_deadline(conn, START + 20, 3) == []


def test_expired_leases_go_back_to_pending_or_fail(driver: Driver, conn: sa.Connection) -> None:
    held = {"state": "running", "owner": "w", "fence": 1}
    stored(driver, conn, "retry", lease_until=START + 5, attempts=1, **held)
    stored(driver, conn, "spent", lease_until=START + 5, attempts=3, **held)
    stored(driver, conn, "held", lease_until=START + 50, attempts=1, **held)
    ended = driver.reap_expired_task_leases(conn, START + 10, 10)
    assert sorted(ended) == [
        EndedTask("retry", "pending", "lease expired"),
        EndedTask("spent", "failed", "lease expired with no attempts left"),
    ]
    found = states(conn)
    assert found["retry"] == ("pending", START + 10)
    assert found["held"][0] == "running"
    assert driver.reap_expired_task_leases(conn, START + 10, 10) == []
