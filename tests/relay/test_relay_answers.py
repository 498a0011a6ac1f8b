"""A relay's last answers per destination: kept by its settled turns, carried by its
announcements into outbox_relays as database times (the console's health rows)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from support.relay_helpers import SECRET, publish_many
from support.scripted_server import Answer, ScriptedServer

from outbox.drivers.records import LastAnswers
from outbox.schema import relays
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.answers import AnswerBook, destination_fault
from relay.figures import Figures
from relay.metrics import RelayMetrics
from relay.policy import Dead, Outcome, Retry, Sent, Unsent, classify
from relay.records import Message
from relay.turn_report import report_turn

LEASE = 40.0


class TickingClock:
    """A clock one second later at every reading: a turn read twice would tell."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_book_gives_each_destinations_last_answers_as_ages() -> None:
    clock = ManualClock(100.0)
    book = AnswerBook(clock)
    assert book.ages() == {}
    book.record_turn({"a"}, {})
    clock.advance(5)
    book.record_turn(set(), {"a": (503, "busy"), "b": (None, "connection refused")})
    clock.advance(2)
    book.record_turn(set(), {"b": (500, "boom")})  # the later failure replaces the earlier
    clock.advance(3)
    assert book.ages() == {
        "a": LastAnswers(sent_age=10.0, failed_age=5.0, status=503, error="busy"),
        "b": LastAnswers(sent_age=None, failed_age=3.0, status=500, error="boom"),
    }


def test_a_turns_deliveries_and_failures_are_one_moment() -> None:
    book = AnswerBook(TickingClock())
    book.record_turn({"a"}, {"a": (503, "busy")})
    [(name, answer)] = book.ages().items()
    assert (name, answer.sent_age, answer.failed_age) == ("a", 1.0, 1.0)


def message(n: int, destination: str = "billing") -> Message:
    """A claimed message to `destination`."""
    return Message(n, f"r-{n}", destination, b"{}", "h", {}, 1, 1, None, 0.0)


@pytest.mark.parametrize(
    ("outcome", "fault"),
    [
        (Sent(200), False),
        (Unsent(), False),
        (Retry(503, "busy"), True),
        (Retry(None, "timeout"), True),
        (classify(503), True),
        (classify(429), True),
        # Refusals of every request to the URL: the destination's.
        (classify(401), True),
        (classify(403), True),
        (classify(404), True),
        (classify(410), True),
        (classify(301), True),
        # Refusals of one message: that message dead, the destination fine.
        (classify(400), False),
        (classify(409), False),
        (classify(413), False),
        (classify(422), False),
        (Dead(None, "header 'Nats-Rollup' is reserved for NATS"), False),
        # Retries spent on failures (the dispatcher's verdict), or a destination the relay
        # does not know.
        (Dead(None, "outcome unknown: retry budget exhausted", of_destination=True), True),
    ],
)
def test_only_failures_that_are_the_destinations_count(outcome: Outcome, fault: bool) -> None:
    assert destination_fault(outcome) is fault


def test_a_turn_tells_the_book_its_deliveries_and_the_destinations_faults() -> None:
    book = AnswerBook(TickingClock())
    metrics = RelayMetrics(lambda: Figures({}, 0, None))
    turn = [message(1), message(2), message(3, "crm"), message(4, "crm"), message(5, "erp")]
    outcomes: dict[int, Outcome] = {
        1: Sent(200),
        2: classify(422),  # one message refused: not billing's fault
        3: Retry(503, "down"),
        # Only looked up (spent before the turn): no attempt, whatever the lookup said.
        4: Dead(None, "outcome unknown: lease expired while sending", of_destination=True),
        5: Sent(None),
    }
    report_turn(turn, outcomes, {m.id for m in turn}, metrics, None, book, looked_up={4, 5})
    ages = book.ages()
    # erp's message was only looked up and found received: no delivery of this turn.
    assert set(ages) == {"billing", "crm"}
    assert (ages["billing"].sent_age, ages["billing"].failed_age) == (1.0, None)
    assert (ages["crm"].failed_age, ages["crm"].status) == (1.0, 503)


def announced(engine: sa.Engine) -> dict[str, dict[str, object]]:
    """outbox_relays' rows by destination."""
    with engine.connect() as conn:
        return {row["destination"]: dict(row) for row in conn.execute(sa.select(relays)).mappings()}


def test_a_relay_announces_its_last_delivery_and_its_last_failure_per_destination(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    destination = make_destination(server.url, secret=SECRET, timeout=2.0)
    start = clock()
    publish_many(engine, ["ok-1", "busy-1"], clock=clock)
    server.script("busy-1", Answer(status=503, body="down for maintenance"))
    with Relay(db_url, {"default": destination}, clock=clock, lease=LEASE) as relay:
        assert sorted(relay.dispatch_once()) == [("busy-1", "retry"), ("ok-1", "sent")]
        # The claim announced before this turn's answers: none yet.
        row = announced(engine)["default"]
        assert (row["announced_at"], row["last_sent_at"], row["last_failed_at"]) == (
            start,
            None,
            None,
        )
        # The next announcement, a quarter lease on, carries them (its claim takes the
        # retry, now due, and the peer accepts it).
        clock.advance(LEASE / 4)
        assert relay.dispatch_once() == [("busy-1", "sent")]
        row = announced(engine)["default"]
        assert row["announced_at"] == start + LEASE / 4
        assert (row["last_sent_at"], row["last_failed_at"]) == (start, start)
        assert row["last_status"] == 503
        assert "down for maintenance" in str(row["last_error"])
        # And the one after: delivered since, the failure kept with its time.
        clock.advance(LEASE / 4)
        assert relay.dispatch_once() == []
        row = announced(engine)["default"]
        assert (row["last_sent_at"], row["last_failed_at"]) == (start + LEASE / 4, start)
