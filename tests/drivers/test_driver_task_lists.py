"""Conformance: the console's lists of tasks by state: the live ones by creation, the
final ones by when they finished, a tenant's alone if asked, either way round, a page at
a time from a keyset."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, add_task

from outbox.drivers import Driver
from outbox.drivers.common.task_lists import select_tasks_in_state
from outbox.drivers.records import ListedTasks
from outbox.schema import tasks

FATES = {
    # task_id: (tenant, state, created, finished)
    "p-2": ("a", "pending", START - 20, None),
    "p-1": ("b", "pending", START - 30, None),
    "p-tie": ("a", "pending", START - 20, None),
    "r-1": ("a", "running", START - 40, None),
    "d-old": ("a", "done", START - 90, START - 80),
    "d-new": ("b", "done", START - 70, START - 5),
    "d-mid": ("a", "done", START - 60, START - 50),
    "f-1": ("a", "failed", START - 60, START - 40),
}


@pytest.fixture
def listed(driver: Driver, conn: sa.Connection) -> Driver:
    """Tasks in several states, of two tenants."""
    for task_id, (tenant, state, created, finished) in FATES.items():
        add_task(conn, task_id, state, created)
        conn.execute(
            tasks.update()
            .where(tasks.c.task_id == task_id)
            .values(tenant_id=tenant, finished_at=finished)
        )
    return driver


def task_ids(driver: Driver, conn: sa.Connection, page: ListedTasks) -> list[str]:
    """The task_ids of one page."""
    return [row["task_id"] for row in driver.tasks_in_state(conn, page)]


def walk(driver: Driver, conn: sa.Connection, page: ListedTasks) -> list[str]:
    """Every page of a list, two to a page, each after the last row of the one before."""
    seen: list[str] = []
    while True:
        rows = driver.tasks_in_state(conn, page._replace(limit=2))
        seen.extend(row["task_id"] for row in rows)
        if len(rows) < 2:
            return seen
        page = page._replace(after=(rows[-1]["listed_key"], rows[-1]["task_id"]))


@pytest.mark.parametrize(
    ("state", "oldest_first"),
    [
        ("pending", ["p-1", "p-2", "p-tie"]),  # by creation, the task_id breaking the tie
        ("running", ["r-1"]),
        ("done", ["d-old", "d-mid", "d-new"]),  # by when they finished
        ("failed", ["f-1"]),
        ("cancelled", []),
    ],
)
def test_each_state_is_listed_in_its_order_both_ways_and_page_by_page(
    listed: Driver, conn: sa.Connection, state: str, oldest_first: list[str]
) -> None:
    assert task_ids(listed, conn, ListedTasks(state)) == oldest_first
    assert task_ids(listed, conn, ListedTasks(state, newest=True)) == oldest_first[::-1]
    assert walk(listed, conn, ListedTasks(state)) == oldest_first
    assert walk(listed, conn, ListedTasks(state, newest=True)) == oldest_first[::-1]


def test_a_tenant_keeps_its_own_and_the_key_comes_with_each_row(
    listed: Driver, conn: sa.Connection
) -> None:
    assert task_ids(listed, conn, ListedTasks("pending", tenant="a")) == ["p-2", "p-tie"]
    assert task_ids(listed, conn, ListedTasks("done", "b")) == ["d-new"]
    [done] = listed.tasks_in_state(conn, ListedTasks("done", limit=1))
    assert (done["task_id"], done["listed_key"]) == ("d-old", START - 80)


# SQLite's planner; PostgreSQL's plans are tests/console/test_console_plans.py's.
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_on_sqlite_a_failed_list_reads_the_unsuccessful_tasks_index(
    listed: Driver, conn: sa.Connection
) -> None:
    statement = select_tasks_in_state(ListedTasks("failed", after=(START, "f-0")))
    sql = str(statement.compile(conn, compile_kwargs={"literal_binds": True}))
    plan = " ".join(str(row[-1]) for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
    assert "ix_outbox_tasks_unsuccessful" in plan, plan
