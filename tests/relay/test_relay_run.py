"""The long-running loop: NOTIFY wake-up, drain on stop, retention check at start."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from support.cli_helpers import running_in_thread
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

from outbox.canonical import sha256_hex
from outbox.operations import Operations
from outbox.schema import messages
from outbox.testing import ManualClock
from relay import ConfigError, Relay, make_destination

EVENT_DEADLINE = 30.0
"""Seconds a test waits for what the relay does next: generous, as a busy machine needs."""
POLL_INTERVAL = 3600.0
"""A poll far beyond EVENT_DEADLINE: within a test only NOTIFY (or a backlog) wakes a relay."""
HELD = 2 * EVENT_DEADLINE
"""Attempt timeout for a destination whose POST a test holds: a held POST cannot end, and a
relay that waited for it could not go on, within EVENT_DEADLINE."""


def wait_until(condition: object, seconds: float) -> bool:
    """Poll `condition()` until true or the deadline passes."""
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        pause.wait(0.002)
    return bool(condition())  # type: ignore[operator]


@contextmanager
def running(relay: Relay) -> Iterator[threading.Thread]:
    """relay.run() in a thread; stopped, joined and closed on the way out."""
    try:
        with running_in_thread(relay) as thread:
            yield thread
    finally:
        relay.close()


def notify_only_relay(db_url: str, server: ScriptedServer) -> Relay:
    """A relay whose poll is an hour away: within a test, only NOTIFY wakes it."""
    return Relay(
        db_url,
        {"default": make_destination(server.url, secret=SECRET, timeout=2)},
        poll_interval=POLL_INTERVAL,
    )


@contextmanager
def holding(server: ScriptedServer, *reply_ids: str) -> Iterator[threading.Event]:
    """Hold the answers to these replies' POSTs until the yielded event is set (on the way
    out at the latest)."""
    release = threading.Event()
    for reply_id in reply_ids:
        server.script(reply_id, Answer(gate=release))
    try:
        yield release
    finally:
        release.set()


def all_sent(engine: sa.Engine) -> bool:
    """Whether every message is recorded as sent."""
    return {row["state"] for row in rows(engine).values()} == {"sent"}


def test_notify_wakes_the_relay_without_waiting_for_the_poll(
    backend: str, db_url: str, engine: sa.Engine, server: ScriptedServer
) -> None:
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite relays poll")
    relay = notify_only_relay(db_url, server)
    with running(relay) as runner:
        assert relay.listening.wait(EVENT_DEADLINE), "relay never started listening"
        for n in range(5):
            publish_many(engine, [f"n-{n}"])
            # The poll is an hour away: only NOTIFY can wake the relay for this one. (How
            # soon it does is measured by the benchmarks' live commit-to-receipt rows.)
            assert wait_until(lambda n=n: f"n-{n}" in server.ids(), EVENT_DEADLINE)  # type: ignore[misc]
        assert server.ids() == [f"n-{n}" for n in range(5)]
    assert not runner.is_alive()


def test_a_keys_next_message_goes_as_soon_as_the_previous_one_is_settled(
    db_url: str, engine: sa.Engine, server: ScriptedServer
) -> None:
    # Five turns of one key, the first refused for good: each message waits for the one
    # before it, and neither a sent nor a dead one may leave the next to the hour-long poll.
    ids = [f"order-1:{step}" for step in ("created", "paid", "packed", "shipped", "closed")]
    publish_many(engine, ids, ordering_key="order-1")
    server.script(ids[0], Answer(status=400))
    relay = notify_only_relay(db_url, server)
    with running(relay):
        assert wait_until(lambda: server.ids() == ids, EVENT_DEADLINE), server.ids()
        assert wait_until(
            lambda: [rows(engine)[i]["state"] for i in ids] == ["dead"] + ["sent"] * 4,
            EVENT_DEADLINE,
        ), rows(engine)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_requeued_dead_message_wakes_the_relay_without_waiting_for_the_poll(
    db_url: str, engine: sa.Engine, server: ScriptedServer
) -> None:
    publish_many(engine, ["was-dead"])
    with engine.begin() as conn:
        conn.execute(sa.update(messages).values(state="dead", last_error="gave up"))
    relay = notify_only_relay(db_url, server)
    with running(relay), Operations(db_url) as operations:
        assert relay.listening.wait(EVENT_DEADLINE), "relay never started listening"
        operations.requeue(
            "was-dead", reason="receiver fixed", by="ops", receipt="not received", forced=False
        )
        # The poll is an hour away: only the requeue's NOTIFY wakes the relay.
        assert wait_until(lambda: server.ids() == ["was-dead"], EVENT_DEADLINE)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_lost_listen_connection_is_replaced_and_notify_wakes_again(
    db_url: str, engine: sa.Engine, server: ScriptedServer
) -> None:
    relay = notify_only_relay(db_url, server)

    def listeners() -> list[int]:
        with engine.connect() as conn:
            query = (
                "SELECT pid FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN %' AND datname = current_database()"
            )
            return list(conn.execute(sa.text(query)).scalars())

    with running(relay):
        assert relay.listening.wait(EVENT_DEADLINE), "relay never started listening"
        [first] = listeners()
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        assert wait_until(lambda: listeners() not in ([], [first]), EVENT_DEADLINE), (
            "never listened again"
        )
        publish_many(engine, ["after-loss"])
        # The poll is an hour away: only a NOTIFY on the new connection wakes the relay.
        assert wait_until(lambda: server.ids() == ["after-loss"], EVENT_DEADLINE)


def test_stop_drains_then_abandons_stalled_work_to_lease_expiry(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["d-1"], clock=clock)
    server.script("d-1", Answer(stall=10))
    destination = make_destination(server.url, secret=SECRET, timeout=8)
    relay = Relay(
        db_url, {"default": destination}, clock=clock, lease=10, grace=0.2, poll_interval=60
    )
    runner = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    runner.start()
    try:
        assert wait_until(lambda: len(server.received) == 1, 10)
        relay.stop()
        runner.join(timeout=5)
        assert not runner.is_alive(), "stop() did not end run() within the grace period"
    finally:
        relay.stop()
        runner.join(timeout=30)
        relay.close()
    assert rows(engine)["d-1"]["state"] == "sending"  # abandoned, not lost
    clock.advance(11)
    with Relay(db_url, {"default": destination}, clock=clock, lease=10, owner="relay-2") as other:
        assert other.dispatch_once() == [("d-1", "sent")]


def test_refuses_to_start_when_receipts_expire_before_the_last_retry(
    db_url: str, clock: ManualClock
) -> None:
    with ScriptedServer(extra_headers={"outbox-receipt-retention": "10"}) as short:
        relay = Relay(
            db_url,
            {"default": make_destination(short.url, secret=SECRET, timeout=2)},
            clock=clock,
            max_attempts=3,
            backoff=2,
        )
        try:
            with pytest.raises(ConfigError, match="keeps receipts for 10s"):
                relay.run(install_signal_handlers=False)
        finally:
            relay.close()
    with ScriptedServer(extra_headers={"outbox-receipt-retention": "2592000"}) as long:
        relay = Relay(
            db_url, {"default": make_destination(long.url, secret=SECRET, timeout=2)}, clock=clock
        )
        try:
            relay._loop.run_until_complete(relay.check_retention())  # accepted: no error
        finally:
            relay.close()


def test_run_settles_every_turn_while_the_next_one_claims(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    ids = [f"t-{n}" for n in range(9)]
    publish_many(engine, ids, clock=clock)
    relay = Relay(
        db_url, {"default": make_destination(server.url, secret=SECRET)}, clock=clock, batch=2
    )
    with running(relay) as runner:
        assert wait_until(lambda: len(server.received) == len(ids), 10)
    assert not runner.is_alive()
    # The last turn's settle ran before run() returned; nothing was sent twice.
    assert {row["state"] for row in rows(engine).values()} == {"sent"}
    assert sorted(server.ids()) == sorted(ids)


def test_run_records_a_failed_settles_outcomes_on_a_later_turn(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish_many(engine, ["f-1", "f-2", "f-3"], clock=clock)
    relay = Relay(
        db_url,
        {"default": make_destination(server.url, secret=SECRET)},
        clock=clock,
        batch=1,
        poll_interval=0.01,
    )
    real_settle = relay.leases._settle
    failures = []

    def refuse_the_first(*args: object, **kwargs: object) -> set[int]:
        if not failures:
            failures.append(args)
            raise RuntimeError("database said no")
        return real_settle(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(relay.leases, "_settle", refuse_the_first)
    with running(relay):
        assert wait_until(lambda: {row["state"] for row in rows(engine).values()} == {"sent"}, 10)
    assert len(failures) == 1
    # The refused settle's outcome was kept and recorded: its reply was never re-sent.
    assert sorted(server.ids()) == ["f-1", "f-2", "f-3"]
    assert {row["attempts"] for row in rows(engine).values()} == {1}


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_message_inserted_by_the_applications_own_sql_wakes_the_relay(
    db_url: str, engine: sa.Engine, server: ScriptedServer
) -> None:
    relay = notify_only_relay(db_url, server)
    with running(relay):
        assert relay.listening.wait(10), "relay never started listening"
        body = b'{"n":1}'
        with engine.begin() as conn:
            conn.execute(
                sa.insert(messages).values(
                    reply_id="raw-1",
                    destination="default",
                    body=body,
                    content_hash=sha256_hex(body),
                    headers="{}",
                    state="pending",
                    attempts=0,
                    fence=0,
                    available_at=0.0,
                    created_at=0.0,
                )
            )
        # The poll is a minute away: only the insert trigger's NOTIFY delivers this soon.
        assert wait_until(lambda: server.ids() == ["raw-1"], 5)


def test_without_a_backlog_a_woken_relay_claims_while_a_post_is_out(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["slow-1"], clock=clock)
    relay = Relay(
        db_url,
        {"default": make_destination(server.url, secret=SECRET, timeout=HELD)},
        clock=clock,
        lease=2 * HELD,
        grace=1,  # on a failure, a held POST is abandoned at once
        batch=10,  # claims are never full: no backlog
        poll_interval=0.05,
    )
    with holding(server, "slow-1") as release, running(relay):
        assert wait_until(lambda: "slow-1" in server.ids(), EVENT_DEADLINE)
        publish_many(engine, ["quick-2"], clock=clock)
        # slow-1's POST is held, and holds its turn: quick-2 goes out in a turn of its own.
        assert wait_until(lambda: "quick-2" in server.ids(), EVENT_DEADLINE)
        assert rows(engine)["slow-1"]["state"] == "sending"
        release.set()
        assert wait_until(lambda: all_sent(engine), EVENT_DEADLINE)
    assert server.ids() == ["slow-1", "quick-2"]


def test_behind_a_backlog_the_next_claim_does_not_wait_for_a_slow_post(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["slow-1", "quick-2"], clock=clock)
    relay = Relay(
        db_url,
        {"default": make_destination(server.url, secret=SECRET, timeout=HELD)},
        clock=clock,
        lease=2 * HELD,
        grace=1,  # on a failure, a held POST is abandoned at once
        batch=1,  # a full claim each turn: a backlog
        poll_interval=POLL_INTERVAL,
    )
    with holding(server, "slow-1") as release, running(relay):
        # slow-1's POST is held, and holds its turn; the next turn claims and sends meanwhile.
        assert wait_until(lambda: "quick-2" in server.ids(), EVENT_DEADLINE)
        assert server.ids()[0] == "slow-1"
        assert rows(engine)["slow-1"]["state"] == "sending"
        release.set()
        assert wait_until(lambda: all_sent(engine), EVENT_DEADLINE)
    assert sorted(server.ids()) == ["quick-2", "slow-1"]


def test_a_destination_with_a_full_pipeline_does_not_stop_claims_for_the_others(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    # Two turns' POSTs to "stuck" are held: its pipeline is full. "ok" must still be
    # claimed, delivered and recorded while they are, in turns of its own.
    relay = Relay(
        db_url,
        {
            "stuck": make_destination(server.url, secret=SECRET, timeout=HELD),
            "ok": make_destination(server.url, secret=SECRET, timeout=HELD),
        },
        clock=clock,
        lease=2 * HELD,
        grace=1,  # on a failure, a held POST is abandoned at once
        batch=10,
        poll_interval=0.05,
    )
    with holding(server, "stuck-1", "stuck-2") as release, running(relay):
        for n in (1, 2):
            publish_many(engine, [f"stuck-{n}"], destination="stuck", clock=clock)
            assert wait_until(lambda: f"stuck-{n}" in server.ids(), EVENT_DEADLINE)  # noqa: B023
        publish_many(engine, ["ok-1", "ok-2"], destination="ok", clock=clock)
        assert wait_until(
            lambda: {rows(engine)[i]["state"] for i in ("ok-1", "ok-2")} == {"sent"},
            EVENT_DEADLINE,
        )
        assert {rows(engine)[i]["state"] for i in ("stuck-1", "stuck-2")} == {"sending"}
        release.set()
        assert wait_until(lambda: all_sent(engine), EVENT_DEADLINE)


def test_a_destination_without_a_published_retention_is_a_warning_or_an_error(
    db_url: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        ScriptedServer() as silent,
        ScriptedServer(extra_headers={"outbox-receipt-retention": "2592000"}) as long,
    ):
        destinations = {
            "quiet": make_destination(silent.url, secret=SECRET, timeout=2),
            "loud": make_destination(long.url, secret=SECRET, timeout=2),
        }
        with Relay(db_url, destinations, clock=clock) as relay:
            relay._loop.run_until_complete(relay.check_retention())
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("'quiet' publishes no receipt retention" in text for text in warned)
        assert not any("'loud'" in text for text in warned)
        strict = {
            "quiet": make_destination(silent.url, secret=SECRET, timeout=2, require_retention=True)
        }
        with (
            Relay(db_url, strict, clock=clock) as relay,
            pytest.raises(
                ConfigError, match=r"'quiet' publishes no receipt retention.*require_retention"
            ),
        ):
            relay._loop.run_until_complete(relay.check_retention())


def test_a_retention_shorter_than_the_retry_window_stops_the_relay_unless_allowed(
    db_url: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    with ScriptedServer(extra_headers={"outbox-receipt-retention": "60"}) as short:
        for allowed in (False, True):
            destination = make_destination(
                short.url, secret=SECRET, timeout=2, allow_short_retention=allowed
            )
            with Relay(db_url, {"short": destination}, clock=clock) as relay:
                check = relay.check_retention()
                if not allowed:
                    with pytest.raises(
                        ConfigError,
                        match=r"keeps receipts for 1m.*retention to at least .*allow_short",
                    ):
                        relay._loop.run_until_complete(check)
                    continue
                relay._loop.run_until_complete(check)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("'short' keeps receipts for 1m" in text for text in warned)


def test_retention_checks_ask_every_destination_at_once(
    db_url: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Each /healthz answers only once both have been asked: asked one after the other,
    # the first would time out unanswered and its retention go unchecked.
    gate = threading.Event()
    with ScriptedServer() as first, ScriptedServer() as second:
        first.health_gate = second.health_gate = gate

        def open_when_both_asked() -> None:
            deadline = time.monotonic() + 10
            while not (first.health_arrivals and second.health_arrivals):
                if time.monotonic() > deadline:
                    return
                gate.wait(0.01)
            gate.set()

        opener = threading.Thread(target=open_when_both_asked)
        opener.start()
        destinations = {
            "first": make_destination(first.url, secret=SECRET, timeout=2),
            "second": make_destination(second.url, secret=SECRET, timeout=2),
        }
        try:
            with Relay(db_url, destinations, clock=clock) as relay:
                relay._loop.run_until_complete(relay.check_retention())
        finally:
            gate.set()
            opener.join()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert not any("not checked" in text for text in warned), warned


def test_close_ends_the_tasks_a_client_left_on_the_loop(db_url: str, clock: ManualClock) -> None:
    # A NATS subscription's reader, say, still waiting when its server went away: collected
    # after the loop closed, it would fail there instead of ending here.
    destination = make_destination("http://127.0.0.1:9/replies", secret=SECRET)
    relay = Relay(db_url, {"default": destination}, clock=clock)
    left = relay._loop.create_task(asyncio.Event().wait())
    relay.close()
    assert left.cancelled()


def test_ready_only_while_the_loop_delivers(db_url: str, engine: sa.Engine) -> None:
    # Ready means delivering: not while the retention check at start waits for the
    # destination's answer, nor once a stop is asked.
    gate = threading.Event()
    with ScriptedServer() as server:
        server.health_gate = gate
        # The check waits for the gate, however long the machine takes to open it.
        relay = Relay(
            db_url,
            {"default": make_destination(server.url, secret=SECRET, timeout=EVENT_DEADLINE)},
            lease=2 * EVENT_DEADLINE,
            poll_interval=POLL_INTERVAL,
        )
        assert relay.readiness() == {
            "ok": False,
            "owner": relay.owner,
            "database": True,
            "delivering": False,
        }
        with running(relay):
            assert wait_until(lambda: server.health_arrivals == 1, EVENT_DEADLINE)
            assert not relay.delivering.is_set()
            # Published while the check waits: the first claim after it takes the message
            # (SQLite has no NOTIFY, and the poll is an hour away).
            publish_many(engine, ["first-claim"])
            gate.set()
            assert wait_until(lambda: relay.readiness()["ok"], EVENT_DEADLINE), "never ready"
            assert wait_until(lambda: server.ids() == ["first-claim"], EVENT_DEADLINE)
            relay.stop()
            assert wait_until(lambda: not relay.readiness()["delivering"], EVENT_DEADLINE)
            assert relay.readiness()["ok"] is False
