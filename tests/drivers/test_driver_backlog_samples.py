"""Conformance: each destination's backlog sampled once a minute by the first relay to try,
read back as the oldest undelivered age per minute, and aged out, on every driver."""

from __future__ import annotations

import sqlalchemy as sa
from support.driver_helpers import START, published, set_state

from outbox.drivers import Driver
from outbox.drivers.common.backlog_samples import SAMPLES_KEPT
from outbox.drivers.common.console import MINUTE
from outbox.schema import backlog_samples

# START is not a minute's start: samples are filed under the minute's.
MINUTE_START = START // MINUTE * MINUTE


def sampled(driver: Driver, conn: sa.Connection, now: float, destinations: list[str]) -> bool:
    """A relay's try at the minute's sample, as it makes it: whether it wrote one."""
    rows = driver.backlog_sample(conn, now, destinations)
    driver.record_backlog_sample(conn, rows)
    return bool(rows)


def samples(conn: sa.Connection) -> list[tuple[float, str, int, float | None]]:
    """Every sample kept, in time and destination order."""
    query = sa.select(backlog_samples).order_by(
        backlog_samples.c.sampled_at, backlog_samples.c.destination
    )
    return [tuple(row) for row in conn.execute(query)]  # type: ignore[misc]


def test_a_minute_is_sampled_once_with_each_destinations_backlog_and_oldest_age(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "o-1", START - 30)
    published(driver, conn, "o-2", START - 10)
    published(driver, conn, "b-1", START - 20, destination="billing")
    published(driver, conn, "b-dead", START - 90, destination="billing")
    set_state(conn, "b-dead", state="dead")
    published(driver, conn, "o-sent", START - 99)
    set_state(conn, "o-sent", state="sent")
    # Each published at the time given: the oldest undelivered of orders 30 s before.
    assert sampled(driver, conn, START, ["orders", "idle"])
    assert samples(conn) == [
        (MINUTE_START, "billing", 1, 20.0),
        (MINUTE_START, "idle", 0, None),
        (MINUTE_START, "orders", 2, 30.0),
    ]
    # A relay trying the same minute again, or another relay, writes nothing.
    assert not sampled(driver, conn, START + 1, ["orders", "shipping"])
    assert len(samples(conn)) == 3
    assert sampled(driver, conn, MINUTE_START + MINUTE, ["orders"])
    assert samples(conn)[3:] == [
        (MINUTE_START + MINUTE, "billing", 1, MINUTE_START + MINUTE - (START - 20)),
        (MINUTE_START + MINUTE, "orders", 2, MINUTE_START + MINUTE - (START - 30)),
    ]


def test_the_oldest_age_is_read_per_minute_for_a_destination_or_the_greatest_of_all(
    driver: Driver, conn: sa.Connection
) -> None:
    rows = [
        (MINUTE_START, "orders", 2, 30.0),
        (MINUTE_START, "billing", 1, 90.0),
        (MINUTE_START, "idle", 0, None),
        (MINUTE_START + MINUTE, "orders", 0, None),
    ]
    conn.execute(
        sa.insert(backlog_samples),
        [
            dict(zip(("sampled_at", "destination", "backlog", "oldest_age"), r, strict=True))
            for r in rows
        ],
    )
    until = MINUTE_START + 2 * MINUTE
    assert driver.oldest_ages(conn, MINUTE_START, until) == {
        MINUTE_START: 90.0,
        MINUTE_START + MINUTE: 0.0,
    }
    assert driver.oldest_ages(conn, MINUTE_START, until, "orders") == {
        MINUTE_START: 30.0,
        MINUTE_START + MINUTE: 0.0,
    }
    # A minute sampled without a row of billing's: nothing of billing's was waiting.
    assert driver.oldest_ages(conn, MINUTE_START + MINUTE, until, "billing") == {
        MINUTE_START + MINUTE: 0.0
    }
    # A minute no relay sampled has no value at all: a gap.
    assert driver.oldest_ages(conn, until, until + MINUTE) == {}


def test_samples_older_than_kept_are_deleted_as_new_ones_are_written(
    driver: Driver, conn: sa.Connection
) -> None:
    assert sampled(driver, conn, START - SAMPLES_KEPT - MINUTE, ["orders"])
    assert sampled(driver, conn, START - SAMPLES_KEPT + MINUTE, ["orders"])
    assert len(samples(conn)) == 2
    assert sampled(driver, conn, START, ["orders"])
    assert [row[0] for row in samples(conn)] == [
        (START - SAMPLES_KEPT + MINUTE) // MINUTE * MINUTE,
        MINUTE_START,
    ]
