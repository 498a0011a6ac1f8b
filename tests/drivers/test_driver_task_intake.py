"""Conformance: the task queue's intake writes, on every registered driver."""

from __future__ import annotations

import sqlalchemy as sa
from support.driver_helpers import START
from support.task_rows import task_values

from outbox.drivers import Driver
from outbox.drivers.task_interface import InboxEntry
from outbox.schema import inbox, tasks


def test_an_inbox_message_is_stored_once(driver: Driver, conn: sa.Connection) -> None:
    assert driver.insert_inbox(conn, "p", "m-1", '{"a":1}', "h1", "t-1", START)
    # The same (principal, message_id) again, with other content: nothing is stored.
    assert not driver.insert_inbox(conn, "p", "m-1", '{"a":2}', "h2", "t-2", START + 5)
    assert driver.inbox_entry(conn, "p", "m-1") == InboxEntry("h1", "t-1")
    rows = conn.execute(sa.select(inbox.c.content, inbox.c.received_at)).all()
    assert [tuple(row) for row in rows] == [('{"a":1}', START)]


def test_another_principal_is_another_inbox_message(driver: Driver, conn: sa.Connection) -> None:
    assert driver.insert_inbox(conn, "p", "m-1", "{}", "h1", "t-1", START)
    assert driver.insert_inbox(conn, "q", "m-1", "{}", "h2", "t-2", START)
    assert driver.inbox_entry(conn, "q", "m-1") == InboxEntry("h2", "t-2")
    assert driver.inbox_entry(conn, "r", "m-1") is None


def test_a_task_is_stored_with_the_values_given(driver: Driver, conn: sa.Connection) -> None:
    driver.insert_task(conn, task_values("t-1", priority=7, last_error=None))
    row = conn.execute(sa.select(tasks).where(tasks.c.task_id == "t-1")).mappings().one()
    assert (row["state"], row["priority"], row["tenant_id"]) == ("pending", 7, "acme")
    assert (row["available_at"], row["deadline"]) == (START, START + 3600)
    assert row["owner"] is None
