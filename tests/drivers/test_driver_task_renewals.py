"""Conformance: renewing task leases, many in one call, and the lease a claim holds, on
every driver."""

from __future__ import annotations

import sqlalchemy as sa
from support.driver_helpers import START
from support.task_rows import task_values

from outbox.drivers import Driver


def held_tasks(driver: Driver, conn: sa.Connection, *task_ids: str) -> None:
    """Tasks running under owner "w" and fence 1 until START + 30."""
    for task_id in task_ids:
        held = {"state": "running", "owner": "w", "fence": 1, "lease_until": START + 30}
        driver.insert_task(conn, task_values(task_id, **held))


def test_held_leases_are_extended_and_lost_ones_left(driver: Driver, conn: sa.Connection) -> None:
    held_tasks(driver, conn, "a", "b", "c")
    asked = [("a", "w", 1), ("b", "w", 1), ("c", "w", 2), ("missing", "w", 1)]
    renewed = driver.renew_leases(conn, asked, 30.0, START + 10)
    assert renewed == {("a", "w", 1): START + 40, ("b", "w", 1): START + 40}
    assert driver.held_lease(conn, ("a", "w", 1), START + 10) == START + 40
    assert driver.renew_leases(conn, [], 30.0, START + 10) == {}


def test_a_lapsed_lease_is_neither_renewed_nor_held(driver: Driver, conn: sa.Connection) -> None:
    held_tasks(driver, conn, "a")
    assert driver.renew_leases(conn, [("a", "w", 1)], 30.0, START + 31) == {}
    assert driver.held_lease(conn, ("a", "w", 1), START + 31) is None
    assert driver.held_lease(conn, ("a", "other", 1), START + 10) is None
