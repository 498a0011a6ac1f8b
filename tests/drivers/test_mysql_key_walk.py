"""MySQL's walk of a destination's keys from the relay's cursor (outbox.drivers.mysql.key_walk):
on after the cursor, then from the first key up to it, and where the next walk begins."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, published

from outbox.drivers import Driver
from outbox.drivers.records import KeyWalk

pytestmark = pytest.mark.parametrize("backend", ["mysql"], indirect=True)
KEYS = ["k1", "k2", "k3", "k4", "k5", "k6"]


def claimed_keys(driver: Driver, engine: sa.Engine, walk: KeyWalk, limit: int) -> list[str]:
    """The keys of the messages one claim of `orders` takes, walking from `walk`."""
    with engine.begin() as conn:
        rows = driver.claim_messages(
            conn,
            owner="relay-1",
            now=START,
            lease=30.0,
            limit=limit,
            budget=3,
            destinations=["orders"],
            keys=walk,
        )
    return sorted(str(row.ordering_key) for row in rows)


@pytest.fixture
def one_message_per_key(driver: Driver, engine: sa.Engine) -> None:
    """A pending message of each of KEYS, due at START."""
    with engine.begin() as conn:
        for key in KEYS:
            published(driver, conn, f"m-{key}", START - 1, ordering_key=key)


@pytest.mark.usefixtures("one_message_per_key")
def test_a_walk_with_room_for_every_key_wraps_and_stops_where_it_began(
    driver: Driver, engine: sa.Engine
) -> None:
    walk = KeyWalk(cursors={"orders": "k4"})
    assert claimed_keys(driver, engine, walk, limit=10) == KEYS
    # Every key visited, the last of them the cursor's own key: the next walk goes on
    # after it, where this one began.
    assert walk.cursors == {"orders": "k4"}


@pytest.mark.usefixtures("one_message_per_key")
def test_a_walk_that_fills_its_claim_goes_on_after_the_last_key_taken(
    driver: Driver, engine: sa.Engine
) -> None:
    walk = KeyWalk(cursors={"orders": "k5"})
    # After k5: k6, then from the first key on: k1, k2.
    assert claimed_keys(driver, engine, walk, limit=3) == ["k1", "k2", "k6"]
    assert walk.cursors == {"orders": "k2"}
    assert claimed_keys(driver, engine, walk, limit=3) == ["k3", "k4", "k5"]
    assert walk.cursors == {"orders": "k5"}
