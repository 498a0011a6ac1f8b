"""EXPLAIN guard: the console's charts, dead list and counts read only what they show.

A chart counts one day of a history that may hold months; the dead list reads
dead rows, which are few beside the delivered ones. Each must walk its index,
even as the generic plan psycopg switches to after five runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from support.console_helpers import client
from test_claim_plans import generic_plan

import outbox
from outbox.dead_filter import DeadFilter
from outbox.drivers import driver_for
from outbox.drivers.base import StateTable
from outbox.drivers.common.console import dead_since, per_minute
from outbox.drivers.common.message_lists import select_messages_in_state
from outbox.drivers.common.operations import (
    LIVE_STATES,
    STATE_TABLES,
    count_in_states,
    select_dead,
)
from outbox.drivers.common.task_lists import select_tasks_in_state
from outbox.drivers.records import ListedPage, ListedTasks
from outbox.operations import Operations
from outbox_cli.console import pages

MINUTES = 20_000  # about two weeks of history, a row a minute of each kind
DAY = 86_400.0
DEAD_ONLY = ("ix_outbox_messages_dead", "ix_outbox_messages_died")
"""The partial indexes that hold dead messages only."""


@pytest.fixture(scope="module")
def history(pg_server: sa.Engine) -> Iterator[sa.Engine]:
    """Two weeks of messages (mostly sent, a few dead) and finished tasks, analyzed, in a
    PostgreSQL database of this module's own: seeded once, read by every test here (none
    writes)."""
    name = f"outbox_plans_{uuid.uuid4().hex[:12]}"
    with pg_server.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = pg_server.url.set(database=name, drivername="postgresql+psycopg")
    outbox.upgrade(url.render_as_string(hide_password=False))
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, "
                "state, attempts, max_attempts, available_at, fence, created_at, updated_at, "
                "finished_at) SELECT 't-' || n, 'a', '{}', 0, 1e12, 0, 'done', 1, 3, 0, 1, "
                "n * 60, n * 60, n * 60 + 1 FROM generate_series(1, :n) n"
            ),
            {"n": MINUTES},
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_messages (reply_id, destination, body, content_hash, "
                "headers, state, attempts, fence, available_at, created_at, sent_at) "
                "SELECT 'm-' || n, CASE WHEN n % 2 = 0 THEN 'a' ELSE 'b' END, '\\x7b7d', 'h', "
                "'{}', CASE WHEN n % 500 = 0 THEN 'dead' ELSE 'sent' END, 1, 1, n * 60, n * 60, "
                "CASE WHEN n % 500 = 0 THEN NULL ELSE n * 60 + 1 END "
                "FROM generate_series(1, :n) n"
            ),
            {"n": MINUTES},
        )
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            "ANALYZE outbox_tasks, outbox_messages"
        )
    yield engine
    engine.dispose()
    with pg_server.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def history_url(history: sa.Engine) -> str:
    """The URL of the module's database, as Operations opens it."""
    return history.url.render_as_string(hide_password=False)


def scans(plan: str) -> list[str]:
    """The plan's scan lines."""
    return [line for line in plan.splitlines() if "Scan" in line]


@pytest.mark.parametrize(
    ("series", "index"),
    [
        ("enqueued", "ix_outbox_messages_created"),
        ("sent", "ix_outbox_messages_sent"),
        ("dead", "ix_outbox_messages_died"),
        ("finished", "ix_outbox_tasks_finished"),
    ],
)
def test_a_chart_reads_its_window_through_its_index(
    history: sa.Engine, series: str, index: str
) -> None:
    until = MINUTES * 60.0
    statement = per_minute(series, until - DAY, until, driver_for("postgresql").floor)
    with history.connect() as conn:
        plan = generic_plan(conn, statement, {"since": until - DAY, "until": until})
    found = scans(plan)
    assert found, plan
    # A BRIN index (created_at's) is read as a bitmap: its scan, then the heap pages it
    # names; a B-tree directly.
    assert all(index in line or "Bitmap Heap Scan" in line for line in found), plan
    assert any(index in line for line in found), plan
    assert "Seq Scan" not in plan, plan


@pytest.mark.parametrize(
    "chosen",
    [
        DeadFilter(),
        DeadFilter(destination="a"),
        DeadFilter(destination="a", error="gone", status=410),
        DeadFilter(after=1000),
    ],
    ids=["all", "destination", "filters", "next-page"],
)
def test_the_dead_list_reads_dead_rows_only(history: sa.Engine, chosen: DeadFilter) -> None:
    statement = select_dead(51, driver_for("postgresql").bound_now(), chosen)
    with history.connect() as conn:
        plan = generic_plan(conn, statement, {"now": None})
    found = scans(plan)
    assert any(index in line for line in found for index in DEAD_ONLY), plan
    assert "Seq Scan" not in plan, plan
    # Every scan walks an index of dead rows only (the next page too: it starts at an id).
    for line in found:
        assert any(index in line for index in DEAD_ONLY), plan


def test_the_overviews_dead_of_the_last_hour_reads_dead_rows_only(history: sa.Engine) -> None:
    since = MINUTES * 60.0 - 3600
    with history.connect() as conn:
        plan = generic_plan(conn, dead_since(since), {"since": since})
    found = scans(plan)
    assert found, plan
    assert "Seq Scan" not in plan, plan
    for line in found:
        assert any(index in line for index in DEAD_ONLY), plan


@pytest.mark.parametrize("table", ["tasks", "messages"])
def test_the_overviews_live_counts_read_their_partial_indexes(
    history: sa.Engine, table: StateTable
) -> None:
    statement = count_in_states(STATE_TABLES[table], LIVE_STATES[table])
    with history.connect() as conn:
        # No parameters: its one plan is the generic one.
        sql = str(statement.compile(dialect=conn.dialect))
        plan = "\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {sql}"))
    found = scans(plan)
    assert len(found) == len(LIVE_STATES[table]), plan
    assert "Seq Scan" not in plan, plan


def test_past_the_threshold_the_final_states_are_estimated_and_the_live_ones_counted(
    history: sa.Engine,
) -> None:
    with Operations(history_url(history)) as ops:
        exact = ops.status()
        estimated = ops.status(estimate_over=MINUTES // 2)
        beneath = ops.status(estimate_over=MINUTES * 2)
    assert "estimated" not in exact  # `outbox status` and any caller that asks for none
    assert beneath["estimated"] == {"tasks": [], "messages": []}
    assert beneath["messages"] == exact["messages"]
    assert estimated["estimated"] == {
        "tasks": ["done", "failed", "cancelled", "expired", "hop_limit"],
        "messages": ["sent", "resolved"],
    }
    # The live states counted exactly, the final ones near the truth (the statistics
    # sample the table).
    assert estimated["messages"]["dead"] == exact["messages"]["dead"] == MINUTES // 500
    assert estimated["tasks"]["pending"] == exact["tasks"]["pending"] == 0
    for table, state in [("tasks", "done"), ("messages", "sent")]:
        assert estimated[table][state] == pytest.approx(exact[table][state], rel=0.05)


def test_the_overview_says_which_counts_are_estimates(
    history: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Operations(history_url(history)) as ops:
        browser = client(ops)
        exact = browser.get("/")
        monkeypatch.setattr(pages, "ESTIMATE_OVER", MINUTES // 2)
        estimated = browser.get("/")
        browser.close()
    assert exact.status_code == estimated.status_code == 200
    assert 'data-estimated="yes"' not in exact.text
    assert 'id="estimated-note"' not in exact.text
    # The final states marked, in words too; the live ones are not.
    assert '<td data-state="sent"><span class="estimate" data-estimated="yes">about ' in (
        estimated.text
    )
    assert f'<td data-state="dead">{MINUTES // 500}</td>' in estimated.text
    assert 'id="estimated-note"' in estimated.text


LIST_INDEXES = {
    "pending": ("ix_outbox_messages_deliverable",),
    "sending": ("ix_outbox_messages_lease",),
    "sent": ("ix_outbox_messages_sent",),
    "dead": DEAD_ONLY,
    "resolved": ("ix_outbox_messages_resolved",),
}
"""The indexes each state's list may walk: they hold that state's rows alone."""


@pytest.mark.parametrize("state", list(LIST_INDEXES))
@pytest.mark.parametrize(
    "page",
    [
        ListedPage("-"),
        ListedPage("-", newest=True),
        ListedPage("-", destination="a", after=(600.0, 10)),
        ListedPage("-", newest=True, after=(MINUTES * 60.0, MINUTES)),
    ],
    ids=["first", "newest", "destination-next", "newest-next"],
)
def test_each_states_list_walks_that_states_index(
    history: sa.Engine, state: str, page: ListedPage
) -> None:
    statement = select_messages_in_state(page._replace(state=state))
    with history.connect() as conn:
        plan = generic_plan(conn, statement, {})
    found = scans(plan)
    assert found, plan
    assert "Seq Scan" not in plan, plan
    walked = [line for line in found if "Index" in line]
    assert walked, plan
    assert all(any(name in line for name in LIST_INDEXES[state]) for line in walked), plan


LIVE_TASKS = (
    "ix_outbox_tasks_claimable",
    "ix_outbox_tasks_running_tenant",
    "ix_outbox_tasks_deadline",
)
TASK_LIST_INDEXES = {
    "pending": LIVE_TASKS,
    "running": LIVE_TASKS,
    "done": ("ix_outbox_tasks_finished",),
    "failed": ("ix_outbox_tasks_unsuccessful",),
}
"""The indexes each state's list of tasks may walk (or read whole, for the live few):
they hold no done history, but for done's own."""


@pytest.mark.parametrize("state", list(TASK_LIST_INDEXES))
@pytest.mark.parametrize(
    "page",
    [
        ListedTasks("-"),
        ListedTasks("-", newest=True, tenant="a"),
        ListedTasks("-", after=(600.0, "t-10")),
    ],
    ids=["first", "newest-tenant", "next"],
)
def test_each_states_list_of_tasks_reads_its_index(
    history: sa.Engine, state: str, page: ListedTasks
) -> None:
    statement = select_tasks_in_state(page._replace(state=state))
    with history.connect() as conn:
        plan = generic_plan(conn, statement, {})
    assert "Seq Scan" not in plan, plan
    walked = [line for line in scans(plan) if "Index" in line]
    assert walked, plan
    assert all(any(name in line for name in TASK_LIST_INDEXES[state]) for line in walked), plan
