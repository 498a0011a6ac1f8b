"""Conformance: task claims (the best claimable first, tenant caps, the claims' setting),
on every driver."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from support.driver_helpers import START
from support.task_rows import task_values

from outbox.drivers import Driver
from outbox.schema import tasks


def stored(driver: Driver, conn: sa.Connection, task_id: str, **more: Any) -> None:
    """A task row with these columns changed from a pending task's due at START."""
    driver.insert_task(conn, task_values(task_id, **more))


def claim(driver: Driver, conn: sa.Connection, limit: int, **more: Any) -> list[str]:
    """The task_ids a claim by "w" leases at START + 10, sorted (rows come in any order)."""
    rows = driver.claim_tasks(conn, owner="w", now=START + 10, lease=30.0, limit=limit, **more)
    return sorted(row["task_id"] for row in rows)


def test_a_claim_leases_the_claimable_tasks_best_first(driver: Driver, conn: sa.Connection) -> None:
    stored(driver, conn, "low", priority=0)
    stored(driver, conn, "high", priority=5)
    stored(driver, conn, "older", priority=0, available_at=START - 5)
    stored(driver, conn, "not-due", available_at=START + 60)
    stored(driver, conn, "cancelling", cancel_requested_at=START)
    stored(driver, conn, "past-deadline", deadline=START + 5)
    stored(driver, conn, "running", state="running", owner="x", lease_until=START + 50)
    assert claim(driver, conn, 2) == ["high", "older"]
    rows = driver.claim_tasks(conn, owner="w", now=START + 10, lease=30.0, limit=10)
    [first] = rows
    assert first["task_id"] == "low"
    assert (first["owner"], first["fence"], first["attempts"]) == ("w", 1, 1)
    assert first["lease_until"] == START + 40
    assert first["payload"] == '{"n":1}'
    leased = conn.execute(sa.select(tasks.c.task_id).where(tasks.c.fence == 1)).scalars()
    assert sorted(leased) == ["high", "low", "older"]
    assert claim(driver, conn, 10) == []


def test_a_claim_takes_at_most_its_limit(driver: Driver, conn: sa.Connection) -> None:
    for n in range(5):
        stored(driver, conn, f"t-{n}", created_at=START + n)
    assert claim(driver, conn, 3) == ["t-0", "t-1", "t-2"]
    assert claim(driver, conn, 3) == ["t-3", "t-4"]


def test_a_capped_claim_leaves_a_tenant_at_its_cap(driver: Driver, conn: sa.Connection) -> None:
    stored(driver, conn, "a-running", state="running", owner="x", lease_until=START + 50)
    stored(driver, conn, "a-1", created_at=START + 1)
    stored(driver, conn, "a-2", created_at=START + 2)
    stored(driver, conn, "b-1", tenant_id="beta", created_at=START + 3)
    stored(driver, conn, "b-2", tenant_id="beta", created_at=START + 4)
    driver.task_claim_transaction_setting(conn)
    assert claim(driver, conn, 10, tenant_cap=2) == ["a-1", "b-1", "b-2"]
    assert claim(driver, conn, 10, tenant_cap=2) == []


def test_the_claims_setting_is_the_backends(driver: Driver, conn: sa.Connection) -> None:
    session = driver.task_claim_session()
    driver.task_claim_transaction_setting(conn)
    if driver.name == "postgresql":
        assert session is not None
        assert "enable_sort" in session
        # Inside the transaction only (SET LOCAL's scope).
        assert conn.exec_driver_sql("SHOW enable_sort").scalar() == "off"
        assert conn.exec_driver_sql("SHOW jit").scalar() == "off"
    else:
        assert session is None
