"""The relay's metrics: per-destination gauges from known rows, and its counters (both backends)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from support.db_faults import database_down
from support.receiver_helpers import wait_until
from support.relay_helpers import SECRET, publish_many
from support.scripted_server import Answer, ScriptedServer

import outbox
from outbox.drivers import driver_for
from outbox.schema import messages
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.figures import DestinationFigures, figures_from

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_once(relay: Relay) -> Samples:
    """Every sample of one scrape: (name, sorted labels) -> value."""
    text = relay.metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def samples(relay: Relay) -> Samples:
    """A scrape whose database reads answered (a busy machine may miss the probe's deadline
    once; the read goes on and a later scrape has it)."""
    found: list[Samples] = []

    def answered() -> bool:
        found[:] = [scrape_once(relay)]
        return found[0]["outbox_relay_database_up", ()] == 1.0

    wait_until(answered, 20, "a scrape with the database figures")
    return found[0]


def by_destination(scrape: dict[Any, float], name: str) -> dict[str, float]:
    """One labelled gauge or counter: destination -> value."""
    return {
        dict(labels)["destination"]: value
        for (sample, labels), value in scrape.items()
        if sample == name
    }


def make_relay(db_url: str, server: ScriptedServer, clock: ManualClock) -> Relay:
    """A relay delivering only `default`."""
    destination = make_destination(server.url, secret=SECRET, timeout=2)
    return Relay(db_url, {"default": destination}, clock=clock)


def set_state(engine: sa.Engine, reply_ids: list[str], state: str) -> None:
    """Put messages in `state` directly, as a relay's work would have."""
    with engine.begin() as conn:
        conn.execute(
            messages.update().where(messages.c.reply_id.in_(reply_ids)).values(state=state)
        )


def test_per_destination_gauges_count_known_rows(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["d-old", "d-sending"], clock=clock)
    clock.advance(10)
    publish_many(engine, ["d-new", "d-dead", "d-sent-1", "d-sent-2"], clock=clock)
    publish_many(engine, ["b-1"], destination="billing", clock=clock)
    publish_many(engine, ["b-dead-1", "b-dead-2"], destination="billing", clock=clock)
    publish_many(engine, ["g-dead"], destination="gone", clock=clock)
    set_state(engine, ["d-sending"], "sending")
    set_state(engine, ["d-dead", "b-dead-1", "b-dead-2", "g-dead"], "dead")
    set_state(engine, ["d-sent-1", "d-sent-2"], "sent")
    clock.advance(50)
    with make_relay(db_url, server, clock) as relay:
        with engine.begin() as conn:  # as its first claim would: it delivers `default`
            driver_for(conn).announce(
                conn, owner=relay.owner, destinations=["default"], lease=600, now=clock()
            )
        scrape = samples(relay)
    assert scrape["outbox_relay_database_up", ()] == 1.0
    assert by_destination(scrape, "outbox_relay_backlog") == {
        "default": 3.0,  # two pending, one sending; sent history is not counted
        "billing": 1.0,
        "gone": 0.0,
    }
    assert by_destination(scrape, "outbox_relay_dead") == {
        "default": 1.0,
        "billing": 2.0,
        "gone": 1.0,
    }
    assert by_destination(scrape, "outbox_relay_oldest_pending_age_seconds") == {
        "default": 60.0,  # d-old and d-sending, published 60 s ago
        "billing": 50.0,
        "gone": 0.0,
    }
    # billing's pending message has no relay; gone has only dead messages.
    assert scrape["outbox_relay_unrouted", ()] == 1.0
    assert scrape["outbox_relay_unrouted_oldest_age_seconds", ()] == 50.0


def test_a_configured_destination_without_messages_reads_zero(
    db_url: str, server: ScriptedServer, clock: ManualClock
) -> None:
    with make_relay(db_url, server, clock) as relay:
        scrape = samples(relay)
    assert by_destination(scrape, "outbox_relay_backlog") == {"default": 0.0}
    assert by_destination(scrape, "outbox_relay_dead") == {"default": 0.0}
    assert by_destination(scrape, "outbox_relay_claimed_total") == {"default": 0.0}
    assert by_destination(scrape, "outbox_relay_lease_losses_total") == {"default": 0.0}
    assert scrape["outbox_relay_unrouted", ()] == 0.0


def test_figures_add_pending_and_sending_and_keep_unrouted_apart() -> None:
    rows = [
        ("a", "pending", 2, 5.0),
        ("a", "sending", 1, 9.0),
        ("a", "dead", 4, None),
        ("b", "pending", 3, 7.0),
    ]
    figures = figures_from(rows, routed={"a"}, configured=["a", "c"])
    assert figures.destinations == {
        "a": DestinationFigures(backlog=3, dead=4, oldest_age=9.0),
        "b": DestinationFigures(backlog=3, dead=0, oldest_age=7.0),
        "c": DestinationFigures(),
    }
    assert (figures.unrouted, figures.unrouted_oldest_age) == (3, 7.0)


def test_claims_and_outcomes_are_counted(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["c-1", "c-2", "c-3"], clock=clock)
    server.script("c-3", Answer(status=410))
    with make_relay(db_url, server, clock) as relay:
        relay.dispatch_once()
        scrape = samples(relay)
    assert by_destination(scrape, "outbox_relay_claimed_total") == {"default": 3.0}
    outcomes = {
        dict(labels)["outcome"]: value
        for (name, labels), value in scrape.items()
        if name == "outbox_relay_outcomes_total"
    }
    assert outcomes == {"sent": 2.0, "dead": 1.0}
    assert by_destination(scrape, "outbox_relay_lease_losses_total") == {"default": 0.0}


def test_an_outcome_refused_because_the_lease_moved_counts_a_lease_loss(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish_many(engine, ["l-1", "l-2"], clock=clock)
    with make_relay(db_url, server, clock) as relay:
        deliver = relay.dispatcher.deliver_batch

        async def deliver_then_lose_the_lease(*claimed: Any) -> Any:
            turn = await deliver(*claimed)
            # Another relay took l-1 over while this one was posting: its fence moved on.
            with engine.begin() as conn:
                conn.execute(
                    messages.update()
                    .where(messages.c.reply_id == "l-1")
                    .values(fence=messages.c.fence + 1)
                )
            return turn

        monkeypatch.setattr(relay.dispatcher, "deliver_batch", deliver_then_lose_the_lease)
        assert relay.dispatch_once() == [("l-2", "sent")]
        scrape = samples(relay)
    assert by_destination(scrape, "outbox_relay_lease_losses_total") == {"default": 1.0}
    assert by_destination(scrape, "outbox_relay_claimed_total") == {"default": 2.0}


def test_a_claim_that_fails_against_the_database_is_counted(
    db_url: str, server: ScriptedServer, clock: ManualClock
) -> None:
    relay_engine = outbox.create_engine(db_url)
    with make_relay(relay_engine, server, clock) as relay:  # type: ignore[arg-type]
        with database_down(relay_engine), pytest.raises(sa.exc.OperationalError):
            relay.dispatch_once()
        with database_down(relay_engine):
            scrape = scrape_once(relay)
    relay_engine.dispose()
    errors = {
        dict(labels)["operation"]: value
        for (name, labels), value in scrape.items()
        if name == "outbox_relay_database_errors_total"
    }
    assert errors == {"claim": 1.0, "settle": 0.0}
    assert scrape["outbox_relay_database_up", ()] == 0.0
