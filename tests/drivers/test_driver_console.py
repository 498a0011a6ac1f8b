"""Conformance: what the console reads, on every registered driver."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, add_task, published, set_state

from outbox.drivers import Driver
from outbox.drivers.common.audit import select_audit_page
from outbox.drivers.records import AuditedPage
from outbox.schema import requeues, task_decisions

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


def reply_decision(driver: Driver, conn: sa.Connection, reply_id: str, by: str, at: float) -> int:
    """A resolve of `reply_id` by `by`, audited at `at`; its audit id."""
    values = {
        "action": "resolve",
        "reply_id": reply_id,
        "requested_by": by,
        "reason": "why",
        "receipt": "not checked",
        "forced": False,
        "previous_attempts": 3,
        "previous_status": 410,
        "previous_error": "gone",
    }
    [row] = driver.insert_decision_audits(conn, [values], at)
    return int(row["id"])


def task_decision(driver: Driver, conn: sa.Connection, task_id: str, by: str, at: float) -> int:
    """A cancel of `task_id` by `by`, audited at `at`; its audit id."""
    values = {"task_id": task_id, "action": "cancel", "requested_by": by, "reason": "why"}
    return int(driver.insert_task_decision(conn, values, at)["id"])


def subjects(rows: list[dict[str, Any]]) -> list[str]:
    """What each audit row is about: its reply_id or task_id."""
    return [row["reply_id"] if row["kind"] == "reply" else row["task_id"] for row in rows]


def walk(driver: Driver, conn: sa.Connection, page: AuditedPage) -> list[list[str]]:
    """Every page from `page` on, as the console pages: `page.limit` - 1 rows shown of the
    `page.limit` of each kind read, more read than shown saying there is an older page,
    each kind's next page before the last of it shown (a kind none of was shown stays)."""
    size = page.limit - 1
    pages: list[list[str]] = []
    while True:
        rows = driver.audit_page(conn, page)
        shown = rows[:size]
        pages.append(subjects(shown))
        if len(rows) <= size:
            return pages
        starts = {
            kind: min([row["id"] for row in shown if row["kind"] == kind], default=None)
            for kind in page.kinds
        }
        page = page._replace(
            reply_before=starts.get("reply") or page.reply_before,
            task_before=starts.get("task") or page.task_before,
        )


def test_the_audit_is_read_newest_first_by_page_and_operator(
    driver: Driver, conn: sa.Connection
) -> None:
    for n, by in enumerate(["anna", "bob", "anna", "anna"]):
        reply_decision(driver, conn, f"m-{n}", by, START + n)

    def page(limit: int, before: int | None = None, by: str | None = None) -> list[str]:
        chosen = AuditedPage(("reply",), by, reply_before=before, limit=limit)
        return [row["reply_id"] for row in driver.audit_page(conn, chosen)]

    assert page(10) == ["m-3", "m-2", "m-1", "m-0"]
    assert page(2) == ["m-3", "m-2"]
    newest = driver.audit_page(conn, AuditedPage(limit=1))[0]
    assert newest["requested_at"] == START + 3
    assert (newest["kind"], newest["task_id"], newest["previous_status"]) == ("reply", None, 410)
    assert page(10, before=newest["id"]) == ["m-2", "m-1", "m-0"]
    assert page(10, by="anna") == ["m-3", "m-2", "m-0"]
    assert page(1, before=newest["id"], by="anna") == ["m-2"]
    assert page(10, by="nobody") == []


def test_the_audit_merges_decisions_about_replies_and_tasks_newest_first(
    driver: Driver, conn: sa.Connection
) -> None:
    reply_decision(driver, conn, "m-1", "anna", START + 1)
    task_decision(driver, conn, "t-1", "bob", START + 2)
    reply_decision(driver, conn, "m-2", "bob", START + 3)
    task_decision(driver, conn, "t-2", "anna", START + 4)
    task_decision(driver, conn, "t-3", "anna", START + 5)
    rows = driver.audit_page(conn, AuditedPage(limit=10))
    assert subjects(rows) == ["t-3", "t-2", "m-2", "t-1", "m-1"]
    assert [row["kind"] for row in rows] == ["task", "task", "reply", "task", "reply"]
    cancel = rows[0]
    assert (cancel["action"], cancel["requested_by"], cancel["requested_at"]) == (
        "cancel",
        "anna",
        START + 5,
    )
    # A task's decision keeps no receipt and no outcome it replaced.
    assert [cancel[name] for name in ("reply_id", "receipt", "forced", "previous_attempts")] == [
        None
    ] * 4
    resolve = rows[2]
    assert (resolve["action"], resolve["receipt"], resolve["forced"]) == (
        "resolve",
        "not checked",
        False,
    )
    assert (resolve["previous_attempts"], resolve["previous_error"]) == (3, "gone")
    assert subjects(driver.audit_page(conn, AuditedPage(by="anna", limit=10))) == [
        "t-3",
        "t-2",
        "m-1",
    ]
    assert subjects(driver.audit_page(conn, AuditedPage(("task",), limit=10))) == [
        "t-3",
        "t-2",
        "t-1",
    ]
    assert subjects(driver.audit_page(conn, AuditedPage(("reply",), "bob", limit=10))) == ["m-2"]


def test_the_audit_reads_each_kind_at_most_its_limit_before_its_own_id(
    driver: Driver, conn: sa.Connection
) -> None:
    replies = [reply_decision(driver, conn, f"m-{n}", "anna", START + 2 * n) for n in range(4)]
    tasks = [task_decision(driver, conn, f"t-{n}", "anna", START + 2 * n + 1) for n in range(4)]
    first = driver.audit_page(conn, AuditedPage(limit=2))
    # Two of each kind, the first two of them the newest two of all.
    assert subjects(first) == ["t-3", "m-3", "t-2", "m-2"]
    page = AuditedPage(reply_before=replies[2], task_before=tasks[3], limit=2)
    assert subjects(driver.audit_page(conn, page)) == ["t-2", "t-1", "m-1", "m-0"]
    assert subjects(driver.audit_page(conn, page._replace(task_before=1))) == ["m-1", "m-0"]


def test_the_audits_pages_cross_from_one_kind_to_the_other_with_none_lost(
    driver: Driver, conn: sa.Connection
) -> None:
    for n in range(3):
        reply_decision(driver, conn, f"m-old-{n}", "anna", START + n)
    for n in range(4):
        task_decision(driver, conn, f"t-{n}", "anna", START + 10 + n)
    reply_decision(driver, conn, "m-new", "anna", START + 20)
    assert walk(driver, conn, AuditedPage(limit=4)) == [
        ["m-new", "t-3", "t-2"],
        ["t-1", "t-0", "m-old-2"],
        ["m-old-1", "m-old-0"],
    ]
    assert walk(driver, conn, AuditedPage(("task",), limit=4)) == [["t-3", "t-2", "t-1"], ["t-0"]]
    assert walk(driver, conn, AuditedPage(("task",), limit=5)) == [["t-3", "t-2", "t-1", "t-0"]]


def test_the_audit_keeps_each_kinds_id_order_where_a_time_is_out_of_it(
    driver: Driver, conn: sa.Connection
) -> None:
    # A manual clock behind (or a long transaction) writes a later id with an earlier time:
    # the kind's next page starts below the last id shown, so none may be passed over.
    reply_decision(driver, conn, "m-1", "anna", START + 10)
    reply_decision(driver, conn, "m-2-early", "anna", START + 1)
    reply_decision(driver, conn, "m-3", "anna", START + 12)
    task_decision(driver, conn, "t-1", "anna", START + 5)
    rows = driver.audit_page(conn, AuditedPage(limit=10))
    # The early one comes after the task, as its time says, but never before m-3, whose
    # id is higher: the next page of replies starts below the last id shown.
    assert subjects(rows) == ["m-3", "t-1", "m-2-early", "m-1"]
    assert walk(driver, conn, AuditedPage(limit=2)) == [["m-3"], ["t-1"], ["m-2-early"], ["m-1"]]


AUDITED = 10_000
"""Decisions of each kind the bounded read is checked against."""


def test_a_page_deep_in_a_long_audit_reads_only_its_own_rows(
    driver: Driver, conn: sa.Connection
) -> None:
    conn.execute(requeues.insert(), [audit_values(n) for n in range(AUDITED)])
    conn.execute(
        task_decisions.insert(),
        [
            {
                "task_id": f"t-{n}",
                "action": "cancel",
                "requested_by": "anna" if n % 2 else "bob",
                "reason": "why",
                "requested_at": START + 2 * n + 1,
            }
            for n in range(AUDITED)
        ],
    )
    last_reply, last_task = (
        conn.execute(sa.select(sa.func.max(table.c.id))).scalar_one()
        for table in (requeues, task_decisions)
    )
    # Past the newest half of the replies and two thirds of the tasks (m-4999 and t-3333
    # the first left): each reply read is later than every task read.
    deep = AuditedPage(
        reply_before=last_reply + 1 - AUDITED // 2,
        task_before=last_task + 1 - 2 * AUDITED // 3,
    )
    rows = driver.audit_page(conn, deep)
    assert len(rows) == 2 * deep.limit
    assert subjects(rows[:2]) == ["m-4999", "m-4998"]
    assert {row["kind"] for row in rows[: deep.limit]} == {"reply"}
    assert subjects(rows[deep.limit :][:2]) == ["t-3333", "t-3332"]
    for page in (AuditedPage(), deep):
        plan = audit_plan(driver, conn, page)
        assert all(sign not in plan for sign in WHOLE_TABLE[driver.name]), plan
    # No index holds one operator's decisions: theirs are found walking back (or, as the
    # planner may prefer, by reading the table), as the audit of replies alone was.
    anna = driver.audit_page(conn, deep._replace(by="anna"))
    assert subjects(anna[:2]) == ["m-4999", "m-4997"]
    assert {row["requested_by"] for row in anna} == {"anna"}


def audit_values(n: int) -> dict[str, Any]:
    """The nth audit row of a long history of resolves, one every other second."""
    return {
        "reply_id": f"m-{n}",
        "requested_by": "anna" if n % 2 else "bob",
        "reason": "why",
        "requested_at": START + 2 * n,
        "receipt": "not checked",
        "forced": False,
        "previous_attempts": 3,
        "previous_status": None,
        "previous_error": None,
        "action": "resolve",
    }


WHOLE_TABLE = {
    "postgresql": ("Seq Scan", "Sort"),
    "sqlite": ("TEMP B-TREE",),
    "mysql": ("filesort",),
}
"""What a plan says when it reads a whole table, or sorts one, rather than walk back along
a primary key and stop at the page's limit."""


def audit_plan(driver: Driver, conn: sa.Connection, page: AuditedPage) -> str:
    """The backend's plan of the audit page's statement."""
    statement = select_audit_page(page)
    sql = str(statement.compile(conn, compile_kwargs={"literal_binds": True}))
    explain = "EXPLAIN QUERY PLAN" if driver.name == "sqlite" else "EXPLAIN"
    return "\n".join(" ".join(map(str, row)) for row in conn.exec_driver_sql(f"{explain} {sql}"))
