"""Conformance: the relay's claim, adopt, settle, reap, announcements and figures, on
every registered driver."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, published, set_state, state_of

from outbox.drivers import Driver
from outbox.drivers.common.announcements import HANDLER_SHOWN, LAPSED_KEPT
from outbox.drivers.records import (
    ClaimedRow,
    FigureRow,
    LastAnswers,
    LeaseState,
    RelayRow,
    Settlement,
    WorkerRow,
)

LEASE = 30.0
BUDGET = 3


def claim(
    driver: Driver, conn: sa.Connection, limit: int = 10, owner: str = "relay-1", **more: Any
) -> list[ClaimedRow]:
    """One claim of `orders` at START, as a relay with this owner makes it."""
    claim: dict[str, Any] = {"destinations": ["orders"]} | more
    return driver.claim_messages(
        conn, owner=owner, now=START, lease=LEASE, limit=limit, budget=BUDGET, **claim
    )


def reply_ids(rows: list[ClaimedRow]) -> list[str]:
    """The reply_ids of claimed rows, in id order."""
    return [row.reply_id for row in sorted(rows, key=lambda row: row.id)]


def outcome(row: ClaimedRow, state: str, **changes: Any) -> Settlement:
    """A settlement of a claimed row under its lease and fence."""
    settled = Settlement(row.id, row.fence, state, 200, None, 0.0, 0, row.lease_until)
    return settled._replace(**changes)


def test_a_claim_takes_due_pending_messages_up_to_its_limit_in_claim_order(
    driver: Driver, conn: sa.Connection
) -> None:
    # Claim order is (available_at, id), across destinations and keys alike.
    published(driver, conn, "late", START - 10, destination="billing")
    published(driver, conn, "early", START - 30)
    published(driver, conn, "middle", START - 20, ordering_key="k")
    published(driver, conn, "not-due", START - 40)
    set_state(conn, "not-due", available_at=START + 5)
    published(driver, conn, "sent", START - 50)
    set_state(conn, "sent", state="sent")
    both = ["orders", "billing"]
    taken = claim(driver, conn, limit=2, destinations=both)
    assert sorted(row.reply_id for row in taken) == ["early", "middle"]
    for row in taken:
        assert (row.attempts, row.previous_attempts, row.fence) == (1, 0, 1)
        assert row.lease_until == START + LEASE
        stored = state_of(conn, row.reply_id)
        assert stored is not None
        assert (stored["state"], stored["owner"], stored["fence"]) == ("sending", "relay-1", 1)
    assert [row.reply_id for row in claim(driver, conn, destinations=both)] == ["late"]
    assert claim(driver, conn, destinations=both) == []


def test_a_claim_takes_only_its_destinations_and_skips_busy_ones(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "o-1", START - 30)
    published(driver, conn, "b-1", START - 20, destination="billing")
    published(driver, conn, "x-1", START - 10, destination="elsewhere")
    taken = claim(driver, conn, destinations=["orders", "billing"], skip_destinations=["billing"])
    assert [row.reply_id for row in taken] == ["o-1"]
    taken = claim(driver, conn, destinations=["orders", "billing"])
    assert [row.reply_id for row in taken] == ["b-1"]
    stored = state_of(conn, "x-1")
    assert stored is not None
    assert stored["state"] == "pending"


def test_a_claim_takes_a_keys_first_message_and_chains_its_successors_in_id_order(
    driver: Driver, conn: sa.Connection
) -> None:
    for n in range(4):
        published(driver, conn, f"k-{n}", START - 10 + n, ordering_key="k")
    published(driver, conn, "other-0", START - 5, ordering_key="other")
    taken = claim(driver, conn)
    assert reply_ids(taken) == ["k-0", "k-1", "k-2", "k-3", "other-0"]
    assert all(row.previous_attempts == 0 and row.attempts == 1 for row in taken)


@pytest.mark.parametrize("gap", ["not-due", "spent"])
def test_a_keys_chain_stops_at_the_first_successor_that_does_not_qualify(
    driver: Driver, conn: sa.Connection, gap: str
) -> None:
    for n in range(4):
        published(driver, conn, f"k-{n}", START - 10, ordering_key="k")
    if gap == "not-due":
        set_state(conn, "k-2", available_at=START + 60, attempts=1)
    else:
        set_state(conn, "k-2", attempts=BUDGET)
    assert reply_ids(claim(driver, conn)) == ["k-0", "k-1"]
    for held in ("k-2", "k-3"):
        stored = state_of(conn, held)
        assert stored is not None
        assert stored["state"] == "pending"


def test_a_chain_is_limited_to_the_room_the_claim_leaves(
    driver: Driver, conn: sa.Connection
) -> None:
    for n in range(5):
        published(driver, conn, f"k-{n}", START - 10, ordering_key="k")
    assert reply_ids(claim(driver, conn, limit=3)) == ["k-0", "k-1", "k-2"]


def test_a_claim_never_takes_a_key_whose_earlier_message_is_sending(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "k-0", START - 20, ordering_key="k")
    published(driver, conn, "k-1", START - 10, ordering_key="k")
    published(driver, conn, "free", START - 5)
    set_state(conn, "k-0", state="sending", owner="relay-2", lease_until=START + 60)
    assert [row.reply_id for row in claim(driver, conn)] == ["free"]


def test_settle_writes_sent_pending_with_its_delay_and_dead(
    driver: Driver, conn: sa.Connection
) -> None:
    for name in ("to-send", "to-retry", "to-kill"):
        published(driver, conn, name, START - 10)
    rows = {row.reply_id: row for row in claim(driver, conn)}
    outcomes = [
        outcome(rows["to-send"], "sent"),
        outcome(rows["to-retry"], "pending", status=503, error="busy", delay=7.5),
        outcome(rows["to-kill"], "dead", status=400, error="refused"),
    ]
    assert driver.settle(conn, "relay-1", outcomes, START + 1) == {r.id for r in rows.values()}
    sent, retried, dead = (state_of(conn, name) for name in ("to-send", "to-retry", "to-kill"))
    assert sent is not None
    assert retried is not None
    assert dead is not None
    assert (sent["state"], sent["sent_at"], sent["last_status"]) == ("sent", START + 1, 200)
    assert (retried["state"], retried["available_at"]) == ("pending", START + 1 + 7.5)
    assert (retried["last_status"], retried["last_error"], retried["sent_at"]) == (
        503,
        "busy",
        None,
    )
    assert (dead["state"], dead["last_error"], dead["sent_at"]) == ("dead", "refused", None)
    for row in (sent, retried, dead):
        assert (row["lease_until"], row["attempts"]) == (None, 1)


@pytest.mark.parametrize("wrong", ["fence", "owner"])
def test_settle_is_fenced(driver: Driver, conn: sa.Connection, wrong: str) -> None:
    published(driver, conn, "m-1", START - 10)
    [row] = claim(driver, conn)
    stale = outcome(row, "sent", fence=row.fence - 1) if wrong == "fence" else outcome(row, "sent")
    owner = "relay-2" if wrong == "owner" else "relay-1"
    assert driver.settle(conn, owner, [stale], START + 1) == set()
    stored = state_of(conn, "m-1")
    assert stored is not None
    assert (stored["state"], stored["lease_until"]) == ("sending", START + LEASE)
    assert driver.settle(conn, "relay-1", [outcome(row, "sent")], START + 1) == {row.id}


def test_settle_gives_back_a_refunded_attempt(driver: Driver, conn: sa.Connection) -> None:
    published(driver, conn, "m-1", START - 10)
    [row] = claim(driver, conn)
    assert row.attempts == 1
    refunded = outcome(row, "pending", status=None, error="not attempted", refund=1)
    assert driver.settle(conn, "relay-1", [refunded], START + 1) == {row.id}
    stored = state_of(conn, "m-1")
    assert stored is not None
    assert (stored["state"], stored["attempts"]) == ("pending", 0)


def test_the_leases_a_settle_left_are_read_back(driver: Driver, conn: sa.Connection) -> None:
    published(driver, conn, "m-1", START - 10)
    published(driver, conn, "m-2", START - 10)
    first, second = sorted(claim(driver, conn), key=lambda row: row.id)
    driver.settle(conn, "relay-1", [outcome(first, "sent")], START + 1)
    assert sorted(driver.lease_states(conn, [first.id, second.id])) == [
        LeaseState(first.id, "sent", "relay-1", 1),
        LeaseState(second.id, "sending", "relay-1", 1),
    ]


def test_reap_returns_expired_sending_messages_to_pending(
    driver: Driver, conn: sa.Connection
) -> None:
    for n in range(3):
        published(driver, conn, f"m-{n}", START - 10)
    claim(driver, conn)
    assert driver.reap_expired_message_leases(conn, START + LEASE - 1, 10) == 0
    assert driver.reap_expired_message_leases(conn, START + LEASE, 2) == 2
    assert driver.reap_expired_message_leases(conn, START + LEASE, 2) == 1
    for n in range(3):
        stored = state_of(conn, f"m-{n}")
        assert stored is not None
        assert (stored["state"], stored["lease_until"]) == ("pending", None)
        assert (stored["available_at"], stored["last_error"]) == (START + LEASE, "lease expired")


def test_adopt_finds_this_owners_sending_rows_under_a_new_fence(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "mine", START - 10)
    published(driver, conn, "theirs", START - 10, destination="billing")
    [mine] = claim(driver, conn)
    claim(driver, conn, owner="relay-2", destinations=["billing"])
    adopted = driver.adopt_messages(conn, owner="relay-1", now=START + 5, lease=LEASE)
    assert [row.reply_id for row in adopted] == ["mine"]
    [row] = adopted
    assert (row.fence, row.lease_until) == (mine.fence + 1, START + 5 + LEASE)
    assert (row.attempts, row.previous_attempts) == (1, 0)
    assert driver.adopt_messages(conn, owner="relay-3", now=START + 5, lease=LEASE) == []


def test_announce_names_only_this_relays_destinations_and_withdraw_forgets_them(
    driver: Driver, conn: sa.Connection
) -> None:
    long_ago = START - LAPSED_KEPT - 20
    driver.announce(conn, owner="dead", destinations=["old"], lease=10, now=long_ago)
    assert driver.live_destinations(conn, long_ago + 5) == {"old"}
    driver.announce(conn, owner="recent", destinations=["new"], lease=10, now=START - 20)
    driver.announce(conn, owner="r-1", destinations=["a", "b"], lease=60, now=START)
    driver.announce(conn, owner="r-2", destinations=["c"], lease=60, now=START)
    assert driver.live_destinations(conn, START) == {"a", "b", "c"}
    # The announcement that lapsed over LAPSED_KEPT ago was deleted on the way; the one
    # that lapsed 10 s ago is kept (the console shows it lapsed), but routes nothing.
    assert driver.live_destinations(conn, long_ago + 5) == {"new", "a", "b", "c"}
    owners = {row.owner for row in driver.relay_announcements(conn)}
    assert owners == {"recent", "r-1", "r-2"}
    driver.announce(conn, owner="r-1", destinations=["a"], lease=60, now=START + 1)
    assert driver.live_destinations(conn, START + 1) == {"a", "c"}
    assert driver.live_destinations(conn, START + 60) == {"a"}
    driver.withdraw(conn, "r-1", START + 2)
    assert driver.live_destinations(conn, START + 2) == {"c"}
    # Withdrawn announcements are kept, lapsed, with their last answers, like a dead relay's.
    withdrawn = [row for row in driver.relay_announcements(conn) if row.owner == "r-1"]
    assert [(row.destination, row.expires_at) for row in withdrawn] == [("a", START + 2)]


def test_announcements_carry_each_destinations_last_answers_as_database_times(
    driver: Driver, conn: sa.Connection
) -> None:
    answers = {"a": LastAnswers(sent_age=5.0, failed_age=2.0, status=503, error="busy")}
    driver.announce(
        conn, owner="r-1", destinations=["a", "b"], lease=60, now=START, answers=answers
    )
    assert driver.relay_announcements(conn) == [
        RelayRow("r-1", "a", START + 60, START, START - 5, START - 2, 503, "busy"),
        RelayRow("r-1", "b", START + 60, START, None, None, None, None),
    ]
    # The next announcement replaces what it knows, and keeps what it does not (a relay
    # restarted under the same name knows nothing yet): a's success, b's failure.
    later = {"a": LastAnswers(1.0, None, None, None), "b": LastAnswers(None, 3.0, None, "timeout")}
    driver.announce(
        conn, owner="r-1", destinations=["a", "b"], lease=60, now=START + 10, answers=later
    )
    assert driver.relay_announcements(conn) == [
        RelayRow("r-1", "a", START + 70, START + 10, START + 9, START - 2, 503, "busy"),
        RelayRow("r-1", "b", START + 70, START + 10, None, START + 7, None, "timeout"),
    ]
    driver.announce(conn, owner="r-1", destinations=["a", "b"], lease=60, now=START + 20)
    assert [row[4:] for row in driver.relay_announcements(conn)] == [
        (START + 9, START - 2, 503, "busy"),
        (None, START + 7, None, "timeout"),
    ]


def test_workers_announce_renew_and_withdraw(driver: Driver, conn: sa.Connection) -> None:
    long_ago = START - LAPSED_KEPT - 60
    worker = {"handler": "app.handle", "concurrency": 4, "lease": 40.0}
    driver.announce_worker(conn, owner="gone", now=long_ago, **worker)
    driver.announce_worker(conn, owner="w-1", now=START, **worker)
    driver.announce_worker(conn, owner="w-1", now=START + 10, **worker | {"concurrency": 8})
    # A renewal keeps the start; the lapsed worker's row was deleted on the way.
    assert driver.worker_announcements(conn) == [
        WorkerRow("w-1", "app.handle", 8, START, START + 10, START + 50)
    ]
    long_name = "app." + "h" * 300
    driver.announce_worker(conn, owner="w-2", now=START, **worker | {"handler": long_name})
    assert [row.handler for row in driver.worker_announcements(conn)] == [
        "app.handle",
        long_name[:HANDLER_SHOWN],
    ]
    driver.withdraw_worker(conn, "w-1")
    assert [row.owner for row in driver.worker_announcements(conn)] == ["w-2"]


def test_figures_count_undelivered_and_dead_messages_per_destination(
    driver: Driver, conn: sa.Connection
) -> None:
    published(driver, conn, "o-1", START - 30)
    published(driver, conn, "o-2", START - 20)
    published(driver, conn, "o-3", START - 10)
    published(driver, conn, "o-4", START - 40)
    published(driver, conn, "b-1", START - 5, destination="billing")
    set_state(conn, "o-2", state="sending")
    set_state(conn, "o-3", state="dead")
    set_state(conn, "o-4", state="sent")
    figures = sorted(driver.destination_figures(conn, START))
    assert figures == [
        FigureRow("billing", "pending", 1, 5.0),
        FigureRow("orders", "dead", 1, None),
        FigureRow("orders", "pending", 1, 30.0),
        FigureRow("orders", "sending", 1, 20.0),
    ]
