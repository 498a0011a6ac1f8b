"""A relay's last answers per destination: kept by its settled turns, carried by its
announcements into outbox_relays as database times (the console's health rows)."""

from __future__ import annotations

import sqlalchemy as sa
from support.relay_helpers import SECRET, publish_many
from support.scripted_server import Answer, ScriptedServer

from outbox.drivers.records import LastAnswers
from outbox.schema import relays
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.answers import AnswerBook

LEASE = 40.0


def test_the_book_gives_each_destinations_last_answers_as_ages() -> None:
    clock = ManualClock(100.0)
    book = AnswerBook(clock)
    assert book.ages() == {}
    book.sent("a")
    clock.advance(5)
    book.failed("a", 503, "busy")
    book.failed("b", None, "connection refused")
    clock.advance(2)
    book.failed("b", 500, "boom")  # the later failure replaces the earlier
    clock.advance(3)
    assert book.ages() == {
        "a": LastAnswers(sent_age=10.0, failed_age=5.0, status=503, error="busy"),
        "b": LastAnswers(sent_age=None, failed_age=3.0, status=500, error="boom"),
    }


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
