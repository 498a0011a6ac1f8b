"""Every delivery outcome class, settled with its status and error kept (both backends)."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.db_faults import terminate_other_sessions
from support.receiver_helpers import wait_until
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

import outbox
from outbox import InvalidMessage, publish
from outbox.drivers import driver_for
from outbox.operations import Operations
from outbox.schema import backlog_samples, failed_attempts
from outbox.signing import parse_secret, verify
from outbox.testing import ManualClock
from relay import ConfigError, Relay, make_destination


def make_relay(db_url: str, server: ScriptedServer, clock: ManualClock, **options: object) -> Relay:
    destination_options = {
        key: options.pop(key) for key in ("timeout", "receipt_lookup") if key in options
    }
    destination = make_destination(
        server.url,
        secret=SECRET,
        **{"timeout": 2.0, **destination_options},  # type: ignore[arg-type]
    )
    return Relay(db_url, {"default": destination}, clock=clock, **options)  # type: ignore[arg-type]


def test_2xx_is_sent_with_the_stored_bytes_signed(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["a-1", "a-2"], clock=clock)
    server.script("a-2", Answer(status=204))
    with make_relay(db_url, server, clock) as relay:
        assert sorted(relay.dispatch_once()) == [("a-1", "sent"), ("a-2", "sent")]
    stored = rows(engine)
    assert {r["state"] for r in stored.values()} == {"sent"}
    assert (stored["a-1"]["last_status"], stored["a-2"]["last_status"]) == (200, 204)
    for request in server.received:
        assert request.body == stored[request.webhook_id]["body"]
        assert verify([parse_secret(SECRET)], request.headers, request.body) == request.webhook_id
        assert request.headers["content-type"] == "application/json"


@pytest.mark.parametrize("status", [400, 401, 404, 409, 410, 422, 301])
def test_permanent_status_is_dead_at_once(
    status: int, db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["p-1"], clock=clock)
    server.script("p-1", Answer(status=status))
    with make_relay(db_url, server, clock, max_attempts=5) as relay:
        assert relay.dispatch_once() == [("p-1", "dead")]
    row = rows(engine)["p-1"]
    assert (row["state"], row["last_status"], row["attempts"]) == ("dead", status, 1)
    assert f"HTTP {status}" in row["last_error"]
    assert SECRET[6:] not in row["last_error"]


@pytest.mark.parametrize(("status", "state"), [(400, "dead"), (503, "retry")])
def test_an_answer_that_echoes_the_url_token_or_secret_stores_and_logs_neither(
    status: int,
    state: str,
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    token = "tok-3f9a2c71e8"
    echo = f"refused POST /hooks?api_key={token} (key {SECRET[6:]}; token {token})"
    publish_many(engine, ["e-1"], clock=clock)
    server.script("e-1", Answer(status=status, body=echo.encode()))
    destination = make_destination(f"{server.url}?api_key={token}", secret=SECRET, timeout=2.0)
    with caplog.at_level("INFO"), Relay(db_url, {"default": destination}, clock=clock) as relay:
        assert relay.dispatch_once() == [("e-1", state)]
    error = rows(engine)["e-1"]["last_error"]
    assert f"HTTP {status}" in error
    assert "<redacted>" in error
    for shown in (error, caplog.text):
        assert token not in shown
        assert SECRET[6:] not in shown


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
def test_transient_status_retries_after_backoff(
    status: int, db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["t-1"], clock=clock)
    server.script("t-1", Answer(status=status))
    with make_relay(db_url, server, clock, backoff=4, max_attempts=3) as relay:
        assert relay.dispatch_once() == [("t-1", "retry")]
        row = rows(engine)["t-1"]
        assert (row["state"], row["last_status"], row["attempts"]) == ("pending", status, 1)
        assert clock() + 2 <= row["available_at"] <= clock() + 4
        assert relay.dispatch_once() == []  # not due yet: nothing is claimed
        clock.advance(4)
        assert relay.dispatch_once() == [("t-1", "sent")]
    assert rows(engine)["t-1"]["attempts"] == 2


def test_retry_after_is_honoured_within_the_cap(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["ra-1", "ra-2"], clock=clock)
    server.script("ra-1", Answer(status=429, headers={"retry-after": "7"}))
    server.script("ra-2", Answer(status=503, headers={"retry-after": "9999"}))
    with make_relay(db_url, server, clock, backoff=1, backoff_cap=60) as relay:
        relay.dispatch_once()
    stored = rows(engine)
    assert stored["ra-1"]["available_at"] == pytest.approx(clock() + 7)
    assert stored["ra-2"]["available_at"] == pytest.approx(clock() + 60)


def test_budget_exhausted_is_dead_outcome_unknown(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["b-1"], clock=clock)
    server.script("b-1", Answer(status=500), Answer(status=500))
    with make_relay(db_url, server, clock, max_attempts=2, backoff=1) as relay:
        assert relay.dispatch_once() == [("b-1", "retry")]
        clock.advance(1)
        assert relay.dispatch_once() == [("b-1", "dead")]
    row = rows(engine)["b-1"]
    assert (row["state"], row["attempts"], row["last_status"]) == ("dead", 2, 500)
    assert row["last_error"].startswith("outcome unknown: retry budget exhausted")
    assert len(server.received) == 2
    # Both attempts are kept with the answer each had, though the second's message then
    # died of its spent budget (the receipt lookup's verdict, not an attempt's).
    with engine.connect() as conn:
        kept = conn.execute(
            sa.select(
                failed_attempts.c.attempt,
                failed_attempts.c.state,
                failed_attempts.c.status,
                failed_attempts.c.error,
            ).order_by(failed_attempts.c.id)
        ).all()
    assert [tuple(r)[:3] for r in kept] == [(1, "pending", 500), (2, "pending", 500)]
    assert all(r.error.startswith("HTTP 500") for r in kept), kept


def test_timeout_bounds_the_whole_attempt_and_retries(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["slow-1", "fast-1"], clock=clock)
    server.script("slow-1", Answer(stall=5.0))
    with make_relay(db_url, server, clock, timeout=0.3) as relay:
        assert sorted(relay.dispatch_once()) == [("fast-1", "sent"), ("slow-1", "retry")]
    row = rows(engine)["slow-1"]
    assert row["state"] == "pending"
    assert "exceeded 0.3s" in row["last_error"]


def test_connection_refused_retries(db_url: str, engine: sa.Engine, clock: ManualClock) -> None:
    publish_many(engine, ["c-1"], clock=clock)
    closed = ScriptedServer()  # never started: its port refuses connections
    with Relay(
        db_url, {"default": make_destination(closed.url, secret=SECRET, timeout=2)}, clock=clock
    ) as relay:
        assert relay.dispatch_once() == [("c-1", "retry")]
    row = rows(engine)["c-1"]
    assert (row["state"], row["last_status"]) == ("pending", None)
    assert "connect" in row["last_error"].lower()


def test_a_destination_this_relay_does_not_deliver_waits_unrouted_not_dead(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["d-1"], clock=clock)
    publish_many(engine, ["u-1"], destination="billing", clock=clock)
    with make_relay(db_url, server, clock) as relay:
        # Another relay may deliver billing (or will, once its config is fixed).
        assert relay.dispatch_once() == [("d-1", "sent")]
        assert relay.dispatch_once() == []
        clock.advance(60)
        assert relay.dispatch_once() == []
        metrics = relay.metrics.render().decode()
        assert "outbox_relay_unrouted 1.0" in metrics
        assert "outbox_relay_unrouted_oldest_age_seconds 60.0" in metrics
        with Operations(db_url, clock=clock) as ops:
            status = ops.status()
        assert (status["unrouted"], status["oldest_unrouted_age"]) == (1, 60.0)
    row = rows(engine)["u-1"]
    assert (row["state"], row["attempts"], row["last_error"]) == ("pending", 0, None)
    assert server.ids() == ["d-1"]


def test_a_second_relay_delivers_what_the_first_does_not_know(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["b-1"], destination="billing", clock=clock)
    billing = {"billing": make_destination(server.url, secret=SECRET, timeout=2)}
    with make_relay(db_url, server, clock) as other, Relay(db_url, billing, clock=clock) as mine:
        assert other.dispatch_once() == []
        with Operations(db_url, clock=clock) as ops:
            assert ops.status()["unrouted"] == 1  # announced: only "default" so far
        assert mine.dispatch_once() == [("b-1", "sent")]
        with Operations(db_url, clock=clock) as ops:
            assert ops.status()["unrouted"] == 0
    assert server.ids() == ["b-1"]


def test_an_announcement_lapses_when_its_relay_is_gone(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["g-1"], clock=clock)
    server.script("g-1", Answer(status=503))
    relay = make_relay(db_url, server, clock, lease=5)
    assert relay.dispatch_once() == [("g-1", "retry")]
    with Operations(db_url, clock=clock) as ops:
        assert ops.status()["unrouted"] == 0  # the relay announced "default"
        # It died without withdrawing: its announcement lapses after two leases and a poll.
        clock.advance(2 * 5 + 1 + 0.1)
        assert ops.status()["unrouted"] == 1
    relay.close()


def test_lease_must_outlast_the_attempt_timeout(db_url: str, server: ScriptedServer) -> None:
    with pytest.raises(ConfigError, match="lease"):
        Relay(
            db_url, {"default": make_destination(server.url, timeout=10, unsigned=True)}, lease=10
        )


@pytest.mark.parametrize("mode", ["single", "batch"])
def test_traceparent_and_headers_captured_at_publish_are_forwarded(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock, mode: str
) -> None:
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with Session(engine) as session, session.begin():
        publish(
            session,
            "default",
            "tp-1",
            {"n": 1},
            clock=clock,
            traceparent=trace,
            headers={"x-tenant": "acme"},
        )
    destination = make_destination(
        server.url,
        secret=SECRET,
        timeout=2,
        mode=mode,
        batch_url=server.url,  # type: ignore[arg-type]
    )
    server.default = Answer(body=b'{"results":[{"reply_id":"tp-1","status":"stored"}]}')
    with Relay(db_url, {"default": destination}, clock=clock) as relay:
        assert relay.dispatch_once() == [("tp-1", "sent")]
    [request] = server.received
    if mode == "single":
        forwarded = request.headers
    else:
        # In a batch each message's headers travel in its item, not as HTTP headers.
        assert "traceparent" not in request.headers
        [item] = json.loads(request.body)["replies"]
        forwarded = item["headers"]
    assert (forwarded["traceparent"], forwarded["x-tenant"]) == (trace, "acme")


@pytest.mark.parametrize(
    "bad",
    [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # uppercase
    ],
)
def test_invalid_traceparent_is_refused_and_nothing_added(bad: str, engine: sa.Engine) -> None:
    with (
        Session(engine) as session,
        session.begin(),
        pytest.raises(InvalidMessage, match="traceparent"),
    ):
        publish(session, "default", "tp-2", {"n": 1}, traceparent=bad)
    assert rows(engine) == {}


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_connections_dropped_under_the_relay_are_replaced(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    # The relay does not ping the connections it checks out: a dropped one must cost a
    # retried claim or settle, not a failed turn.
    publish_many(engine, ["d-1"], clock=clock)
    with make_relay(db_url, server, clock) as relay:
        assert relay.dispatch_once() == [("d-1", "sent")]
        publish_many(engine, ["d-2"], clock=clock)
        assert terminate_other_sessions(db_url) >= 1
        assert relay.dispatch_once() == [("d-2", "sent")]
    assert {row["state"] for row in rows(engine).values()} == {"sent"}


def test_metrics_and_liveness_answer_while_the_database_does_not(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    relay_engine = outbox.create_engine(db_url)
    with make_relay(relay_engine, server, clock) as relay:
        # Not delivering: run() is not running (tests/relay/test_relay_run.py has it ready).
        assert relay.readiness() == {
            "ok": False,
            "owner": relay.owner,
            "database": True,
            "delivering": False,
        }
        assert "outbox_relay_database_up 1.0" in relay.metrics.render().decode()

        @sa.event.listens_for(relay_engine, "do_connect")
        def refuse(*args: object) -> None:
            raise ConnectionRefusedError("the database is down")

        relay_engine.dispose()
        # The last good reads are kept for a second: poll until the scrape says so.
        wait_until(
            lambda: "outbox_relay_database_up 0.0" in relay.metrics.render().decode(),
            10,
            "a scrape that says the database is down",
        )
        text = relay.metrics.render().decode()
        for gauge in ("outbox_relay_backlog", "outbox_relay_dead", "outbox_relay_unrouted"):
            assert gauge not in text  # left out, not a made-up figure
        assert "outbox_relay_delivery_seconds" in text  # the relay's own figures still answer
        wait_until(lambda: not relay.readiness()["database"], 10, "the database down")
        assert relay.readiness() == {
            "ok": False,
            "owner": relay.owner,
            "database": False,
            "delivering": False,
        }
        assert relay.health()["ok"] is True  # alive: the loop is not stuck
        sa.event.remove(relay_engine, "do_connect", refuse)
    relay_engine.dispose()


def test_a_message_going_dead_is_a_warning_with_its_fields_and_each_turn_sums_up(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    publish_many(engine, ["ok-1", "gone-1", "busy-1"], clock=clock)
    server.script("gone-1", Answer(status=410))
    server.script("busy-1", Answer(status=503))
    caplog.set_level("INFO", logger="outbox.relay")
    with make_relay(db_url, server, clock) as relay:
        relay.dispatch_once()
    [dead] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert dead.fields == {  # type: ignore[attr-defined]
        "reply_id": "gone-1",
        "destination": "default",
        "outcome": "dead",
        "status": 410,
        "reason": "HTTP 410: {}",  # with the start of the answer's body
    }
    [summary] = [r for r in caplog.records if r.getMessage().startswith("turn for")]
    assert summary.getMessage() == (
        "turn for default: 3 claimed, 3 settled: 1 sent, 1 retried, 1 dead"
    )
    assert summary.fields == {  # type: ignore[attr-defined]
        "destination": "default",
        "claimed": 3,
        "settled": 3,
        "sent": 1,
        "retry": 1,
        "dead": 1,
    }


def test_a_relay_samples_each_minutes_backlog_once_and_records_failed_attempts(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["s-1"], clock=clock)
    server.script("s-1", Answer(status=503))
    with make_relay(db_url, server, clock, backoff=100, backoff_cap=200) as relay:
        assert relay.dispatch_once() == [("s-1", "retry")]
        clock.advance(5)
        relay.dispatch_once()  # too soon to try the sample again
        clock.advance(60)
        relay.dispatch_once()  # a later minute: sampled
    with engine.connect() as conn:
        sampled = conn.execute(
            sa.select(backlog_samples.c.destination, backlog_samples.c.backlog)
        ).all()
        attempts = conn.execute(
            sa.select(failed_attempts.c.attempt, failed_attempts.c.status)
        ).all()
    assert sorted(sampled) == [("default", 1), ("default", 1)]
    assert attempts == [(1, 503)]


def test_a_message_of_a_destination_the_relay_does_not_know_dies_with_no_attempt_kept(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    # Claimed under a configuration that named its destination (adopted after a restart
    # without it): it dies unattempted, and the timeline keeps no attempt of it.
    publish_many(engine, ["gone-1"], destination="retired", clock=clock)
    with make_relay(db_url, server, clock) as relay:
        with engine.begin() as conn:
            driver_for(engine).claim_messages(
                conn, owner=relay.owner, now=clock(), lease=30, limit=1, budget=3,
                destinations=["retired"],
            )  # fmt: skip
        relay.leases.claim_in_doubt = True  # adopted at the next claim
        assert relay.dispatch_once() == [("gone-1", "dead")]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(failed_attempts)).scalar() == 0
    assert rows(engine)["gone-1"]["last_error"].startswith("unknown destination")
