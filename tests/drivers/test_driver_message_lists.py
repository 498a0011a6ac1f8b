"""Conformance: the console's lists of messages by state, each in its index's order, a
destination's alone if asked, either way round, a page at a time from a keyset."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, published, set_state

from outbox.drivers import Driver
from outbox.drivers.records import ListedPage

FATES = {
    # reply_id: (destination, state, the listed column's value)
    "p-late": ("a", "pending", {"available_at": START + 30}),
    "p-soon": ("a", "pending", {"available_at": START + 10}),
    "p-tie": ("b", "pending", {"available_at": START + 10}),
    "s-1": ("a", "sending", {"lease_until": START + 5, "owner": "r"}),
    "d-1": ("a", "dead", {}),
    "d-2": ("b", "dead", {}),
    "sent-old": ("a", "sent", {"sent_at": START - 50}),
    "sent-new": ("a", "sent", {"sent_at": START - 5}),
    "sent-b": ("b", "sent", {"sent_at": START - 20}),
    "r-1": ("b", "resolved", {"resolved_at": START}),
}


@pytest.fixture
def listed(driver: Driver, conn: sa.Connection) -> Driver:
    """Messages in every state, created in FATES' order."""
    for n, (reply_id, (destination, state, values)) in enumerate(FATES.items()):
        published(driver, conn, reply_id, START - 100 + n, destination=destination)
        if state != "pending" or values:
            set_state(conn, reply_id, state=state, **values)
    return driver


def reply_ids(driver: Driver, conn: sa.Connection, page: ListedPage) -> list[str]:
    """The reply_ids of one page."""
    return [row["reply_id"] for row in driver.messages_in_state(conn, page)]


def walk(driver: Driver, conn: sa.Connection, page: ListedPage) -> list[str]:
    """Every page of a list, two to a page, each after the last row of the one before."""
    seen: list[str] = []
    while True:
        rows = driver.messages_in_state(conn, page._replace(limit=2))
        seen.extend(row["reply_id"] for row in rows)
        if len(rows) < 2:
            return seen
        page = page._replace(after=(rows[-1]["listed_key"], rows[-1]["id"]))


@pytest.mark.parametrize(
    ("state", "oldest_first"),
    [
        # Due first, the id breaking the tie; by lease end; by when sent; by creation.
        ("pending", ["p-soon", "p-tie", "p-late"]),
        ("sending", ["s-1"]),
        ("sent", ["sent-old", "sent-b", "sent-new"]),
        ("dead", ["d-1", "d-2"]),
        ("resolved", ["r-1"]),
    ],
)
def test_each_state_is_listed_in_its_order_both_ways_and_page_by_page(
    listed: Driver, conn: sa.Connection, state: str, oldest_first: list[str]
) -> None:
    assert reply_ids(listed, conn, ListedPage(state)) == oldest_first
    assert reply_ids(listed, conn, ListedPage(state, newest=True)) == oldest_first[::-1]
    assert walk(listed, conn, ListedPage(state)) == oldest_first
    assert walk(listed, conn, ListedPage(state, newest=True)) == oldest_first[::-1]


def test_a_destination_keeps_its_own_and_the_key_comes_with_each_row(
    listed: Driver, conn: sa.Connection
) -> None:
    assert reply_ids(listed, conn, ListedPage("pending", destination="a")) == ["p-soon", "p-late"]
    assert reply_ids(listed, conn, ListedPage("sent", "b")) == ["sent-b"]
    assert reply_ids(listed, conn, ListedPage("dead", "nowhere")) == []
    [due] = listed.messages_in_state(conn, ListedPage("pending", "a", limit=1))
    assert (due["reply_id"], due["listed_key"]) == ("p-soon", START + 10)
    [dead] = listed.messages_in_state(conn, ListedPage("dead", limit=1))
    assert dead["listed_key"] == dead["id"]
