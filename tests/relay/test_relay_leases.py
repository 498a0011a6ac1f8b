"""Fencing, ordering and lease expiry in the relay (both backends)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import sqlalchemy as sa
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

from outbox import TaskQueue
from outbox.operations import Operations
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.policy import Sent


def relay_for(
    db_url: str, server: ScriptedServer, clock: ManualClock, owner: str, **options: object
) -> Relay:
    destination = make_destination(server.url, secret=SECRET, timeout=2)
    return Relay(db_url, {"default": destination}, owner=owner, clock=clock, **options)  # type: ignore[arg-type]


def test_a_stale_relays_settle_is_refused(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["s-1"], clock=clock)
    with (
        relay_for(db_url, server, clock, "relay-a", lease=5) as stale,
        relay_for(db_url, server, clock, "relay-b", lease=5) as fresh,
    ):
        claimed, _ = stale.leases.claim()
        assert [m.reply_id for m in claimed] == ["s-1"]
        clock.advance(6)  # relay-a stalls past its lease
        assert fresh.dispatch_once() == [("s-1", "sent")]
        row = rows(engine)["s-1"]
        assert (row["owner"], row["fence"], row["state"]) == ("relay-b", 2, "sent")
        assert stale.leases.settle(claimed, {claimed[0].id: Sent(200)}) == set()
    after = rows(engine)["s-1"]
    assert (after["owner"], after["fence"], after["state"]) == ("relay-b", 2, "sent")


def test_two_relays_never_deliver_one_row_twice_while_leases_hold(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    ids = [f"m-{n:03d}" for n in range(120)]
    publish_many(engine, ids, clock=clock)
    relays = [relay_for(db_url, server, clock, f"relay-{n}", batch=7) for n in range(2)]
    start = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def drain(relay: Relay) -> None:
        try:
            start.wait()
            while relay.dispatch_once():
                pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(r,)) for r in relays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for relay in relays:
        relay.close()
    assert errors == []
    assert Counter(server.ids()) == Counter(ids)  # each exactly once
    stored = rows(engine)
    assert {r["state"] for r in stored.values()} == {"sent"}
    assert {r["owner"] for r in stored.values()} == {"relay-0", "relay-1"}


def test_ordering_key_delivers_in_commit_order_across_a_retry(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["k-1", "k-2", "k-3"], ordering_key="order-9", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)
    server.script("k-1", Answer(status=503))
    with relay_for(db_url, server, clock, "relay-1", backoff=2) as relay:
        # k-2 and k-3 came with k-1 and are held back, unsent, behind its retry.
        assert sorted(relay.dispatch_once()) == [
            ("free-1", "sent"),
            ("k-1", "retry"),
            ("k-2", "retry"),
            ("k-3", "retry"),
        ]
        assert relay.dispatch_once() == []  # k-2 waits behind the retried k-1
        clock.advance(2)
        for _ in range(5):
            relay.dispatch_once()
    keyed = [i for i in server.ids() if i.startswith("k-")]
    assert keyed == ["k-1", "k-1", "k-2", "k-3"]
    assert {r["state"] for r in rows(engine).values()} == {"sent"}


def test_a_resolved_message_is_never_claimed_and_holds_no_ordering_key(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["k-1"], ordering_key="order-4", clock=clock)
    publish_many(engine, ["done-1"], clock=clock)
    for reply_id in ("k-1", "done-1"):
        server.script(reply_id, Answer(status=410))
    with relay_for(db_url, server, clock, "relay-1", lease=5) as relay:
        assert sorted(relay.dispatch_once()) == [("done-1", "dead"), ("k-1", "dead")]
        # Published after k-1 died: not chained with it, so the resolve below decides.
        publish_many(engine, ["k-2"], ordering_key="order-4", clock=clock)
        with Operations(db_url, clock=clock) as ops:
            for reply_id in ("k-1", "done-1"):
                ops.resolve(reply_id, reason="the destination confirmed it", by="ops")
        # Due, unleased and long past any lease: still nothing a claim may take.
        clock.advance(60)
        assert relay.dispatch_once() == [("k-2", "sent")]  # k-1 no longer holds the key
        clock.advance(60)
        assert relay.dispatch_once() == []
        assert 'outbox_relay_backlog{destination="default"} 0.0' in relay.metrics.render().decode()
    assert Counter(server.ids()) == Counter(["k-1", "done-1", "k-2"])  # each posted once
    assert {r: row["state"] for r, row in rows(engine).items()} == {
        "k-1": "resolved",
        "k-2": "sent",
        "done-1": "resolved",
    }


def test_lease_expired_with_no_attempts_left_is_dead_outcome_unknown(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["x-1"], clock=clock)
    with (
        relay_for(db_url, server, clock, "relay-a", max_attempts=1, lease=5) as crashed,
        relay_for(db_url, server, clock, "relay-b", max_attempts=1, lease=5) as survivor,
    ):
        claimed, _ = crashed.leases.claim()  # claimed, then the process died mid-send
        assert len(claimed) == 1
        clock.advance(6)
        assert survivor.dispatch_once() == [("x-1", "dead")]
    row = rows(engine)["x-1"]
    assert (row["state"], row["attempts"], row["owner"]) == ("dead", 1, "relay-b")
    assert row["last_error"] == "outcome unknown: lease expired while sending"
    assert server.received == []  # never sent again without attempts left


def test_queue_reconcile_hands_expired_deliveries_back(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["r-1"], clock=clock)
    with relay_for(db_url, server, clock, "relay-a", max_attempts=3, lease=5) as relay:
        claimed, _ = relay.leases.claim()
        assert len(claimed) == 1
        clock.advance(6)
        queue = TaskQueue(db_url, clock=clock)
        try:
            assert queue.reconcile()["messages_requeued"] == 1
        finally:
            queue.close()
        assert rows(engine)["r-1"]["state"] == "pending"
        assert relay.dispatch_once() == [("r-1", "sent")]
    assert rows(engine)["r-1"]["attempts"] == 2


def test_a_claim_takes_at_most_one_batch(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, [f"l-{n:02d}" for n in range(30)], clock=clock)
    with relay_for(db_url, server, clock, "relay-1", batch=7) as relay:
        claimed, _ = relay.leases.claim()
        assert len(claimed) == 7
    states = [r["state"] for r in rows(engine).values()]
    assert (states.count("sending"), states.count("pending")) == (7, 23)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_claims_run_on_generic_plans_and_the_setting_stays_on_their_connection(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    # A custom plan of the claim costs more to plan than to run for a few rows: the
    # claims' own connection plans it once, generically, for every claim after.
    with relay_for(db_url, server, clock, "relay-a") as relay:
        for n in range(8):  # psycopg prepares a statement at its fifth run
            publish_many(engine, [f"g-{n}"], clock=clock)
            assert [m.reply_id for m in relay.leases.claim()[0]] == [f"g-{n}"]
        with relay.leases._claims.connection() as conn:
            generic, custom = conn.exec_driver_sql(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE 'WITH RECURSIVE walk%%'"
            ).one()
            # Never JIT: a generic plan's estimate behind a backlog would compile each claim.
            assert conn.exec_driver_sql("SHOW jit").scalar() == "off"
        assert custom == 0
        assert generic > 0
        with relay.leases._settles.connection() as conn:  # the settles' keep the defaults
            changed = conn.exec_driver_sql(
                "SELECT name FROM pg_settings WHERE name IN ('plan_cache_mode', 'jit') "
                "AND setting <> reset_val"
            ).all()
            assert changed == []
