"""Single mode with chained keys: a key's messages go one POST at a time, in id order,
and a key stops at its first message that ends neither sent nor dead."""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.policy import HELD


def relay_for(db_url: str, server: ScriptedServer, clock: ManualClock, **options: object) -> Relay:
    destination = make_destination(server.url, secret=SECRET, timeout=5)
    return Relay(db_url, {"default": destination}, owner="relay-1", clock=clock, **options)  # type: ignore[arg-type]


def test_a_key_stops_at_its_first_retry_and_its_later_messages_are_refunded(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, [f"k-{n}" for n in range(1, 5)], ordering_key="K", clock=clock)
    publish_many(engine, ["free-1", "free-2"], clock=clock)
    server.script("k-2", Answer(status=503))
    with relay_for(db_url, server, clock) as relay:
        verdicts = dict(relay.dispatch_once())
        assert verdicts == {
            "k-1": "sent",
            "k-2": "retry",
            "k-3": "retry",
            "k-4": "retry",
            "free-1": "sent",
            "free-2": "sent",
        }
        keyed = [i for i in server.ids() if i.startswith("k-")]
        assert keyed == ["k-1", "k-2"]  # k-3 and k-4 never went
        stored = rows(engine)
        for held in ("k-3", "k-4"):
            row = stored[held]
            # Pending at once with the attempt given back: nothing was sent, and they
            # cannot go before k-2 anyway.
            assert (row["state"], row["attempts"]) == ("pending", 0), held
            assert row["available_at"] == clock()
            assert row["last_error"] == HELD.error
        assert (stored["k-2"]["state"], stored["k-2"]["attempts"]) == ("pending", 1)
        assert stored["k-2"]["available_at"] > clock()
        assert relay.dispatch_once() == []  # all of K waits behind k-2's backoff
        clock.advance(10)
        assert dict(relay.dispatch_once()) == {"k-2": "sent", "k-3": "sent", "k-4": "sent"}
    keyed = [i for i in server.ids() if i.startswith("k-")]
    assert keyed == ["k-1", "k-2", "k-2", "k-3", "k-4"]


def test_a_dead_message_releases_its_key_within_the_turn(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, [f"k-{n}" for n in range(1, 5)], ordering_key="K", clock=clock)
    server.script("k-2", Answer(status=410))
    with relay_for(db_url, server, clock) as relay:
        assert dict(relay.dispatch_once()) == {
            "k-1": "sent",
            "k-2": "dead",
            "k-3": "sent",
            "k-4": "sent",
        }
    assert server.ids() == ["k-1", "k-2", "k-3", "k-4"]


def test_many_keys_each_go_in_order_in_one_turn(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    keys = [f"key{k}" for k in range(5)]
    for key in keys:
        publish_many(engine, [f"{key}-{n}" for n in range(8)], ordering_key=key, clock=clock)
    with relay_for(db_url, server, clock) as relay:
        verdicts = relay.dispatch_once()
    assert len(verdicts) == 40
    assert {v for _, v in verdicts} == {"sent"}
    for key in keys:
        arrived = [i for i in server.ids() if i.startswith(f"{key}-")]
        assert arrived == [f"{key}-{n}" for n in range(8)]


def test_other_keys_and_unkeyed_messages_go_while_a_key_waits_for_its_answer(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["a-1", "a-2"], ordering_key="A", clock=clock)
    publish_many(engine, ["b-1", "b-2", "b-3"], ordering_key="B", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)
    gate = threading.Event()
    server.script("a-1", Answer(gate=gate))
    verdicts: list[tuple[str, str]] = []
    try:
        with relay_for(db_url, server, clock) as relay:
            turn = threading.Thread(target=lambda: verdicts.extend(relay.dispatch_once()))
            turn.start()
            others = {"b-1", "b-2", "b-3", "free-1"}
            deadline = time.monotonic() + 10
            while not others <= set(server.ids()) and time.monotonic() < deadline:
                gate.wait(0.02)
            # B's whole chain and the unkeyed message went while a-1 was unanswered, and
            # a-2 waits for a-1.
            assert others <= set(server.ids())
            assert "a-2" not in server.ids()
            gate.set()
            turn.join(timeout=15)
    finally:
        gate.set()
    assert sorted(verdicts) == sorted(
        (i, "sent") for i in ("a-1", "a-2", "b-1", "b-2", "b-3", "free-1")
    )
    assert [i for i in server.ids() if i.startswith("a-")] == ["a-1", "a-2"]
