"""Conformance: results written with their replies, and task replies alone, on every
driver."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from support.driver_helpers import START, message_row
from support.task_rows import task_values

from outbox.drivers import Driver
from outbox.schema import messages


def held_tasks(driver: Driver, conn: sa.Connection, *task_ids: str) -> None:
    """Tasks running under owner "w" and fence 1 until START + 30."""
    for task_id in task_ids:
        held = {"state": "running", "owner": "w", "fence": 1, "lease_until": START + 30}
        driver.insert_task(conn, task_values(task_id, **held))


def reply(task_id: str) -> dict[str, Any]:
    """A reply row of task `task_id`."""
    return message_row(f"reply:{task_id}", task_id=task_id, destination="replies")


def stored_replies(conn: sa.Connection) -> dict[str, tuple[str, float]]:
    """Each stored message's reply_id, state and available_at."""
    rows = conn.execute(sa.select(messages.c.reply_id, messages.c.state, messages.c.available_at))
    return {reply_id: (state, at) for reply_id, state, at in rows}


def test_held_tasks_are_done_with_their_replies(driver: Driver, conn: sa.Connection) -> None:
    held_tasks(driver, conn, "a", "b", "c")
    completions = [("a", "w", 1, '"ra"'), ("b", "w", 2, '"stale"'), ("c", "w", 1, '"rc"')]
    replies = [reply("a"), reply("b"), reply("c")]
    done = driver.complete_tasks(conn, completions, replies, START + 10)
    assert done == {"a", "c"}
    assert stored_replies(conn) == {
        "reply:a": ("pending", START + 10),
        "reply:c": ("pending", START + 10),
    }
    a, b = driver.task_row(conn, "a"), driver.task_row(conn, "b")
    assert a is not None
    assert b is not None
    assert (a["state"], a["result"], a["finished_at"], a["lease_until"]) == (
        "done",
        '"ra"',
        START + 10,
        None,
    )
    assert b["state"] == "running"
    # Written once: the same completion again changes nothing.
    assert driver.complete_tasks(conn, completions[:1], replies[:1], START + 11) == set()
    assert driver.complete_tasks(conn, [], [], START + 11) == set()


def test_a_lapsed_lease_finishes_nothing(driver: Driver, conn: sa.Connection) -> None:
    held_tasks(driver, conn, "a")
    assert driver.complete_tasks(conn, [("a", "w", 1, "1")], [reply("a")], START + 31) == set()
    assert stored_replies(conn) == {}


def test_task_replies_are_inserted_pending_and_due(driver: Driver, conn: sa.Connection) -> None:
    driver.insert_task_replies(conn, [reply("x"), reply("y")], START + 5)
    driver.insert_task_replies(conn, [], START + 5)
    assert stored_replies(conn) == {
        "reply:x": ("pending", START + 5),
        "reply:y": ("pending", START + 5),
    }
