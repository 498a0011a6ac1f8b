"""Destinations of kind rabbitmq, against the local RabbitMQ.

Each message is queued with its exact bytes, message_id = reply_id, persistent,
and the broker headers (signature, content hash, traceparent); the publisher
confirm is the ACK; an unroutable message is dead with that reason; a missing
exchange stops the relay at start. Each test has its own exchange and queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.rabbitmq import AMQP_URL, delete_exchange, take_all, topology, unique
from support.relay_helpers import SECRET, publish_many, rows

from outbox import publish
from outbox.schema import messages
from outbox.signing import CONTENT_HASH_HEADER, ORDERING_KEY_HEADER, parse_secret, verify
from outbox.testing import ManualClock
from outbox_cli import main
from relay import ConfigError, Destination, Relay, make_destination
from relay.transports.rabbitmq import MAX_ROUTING_KEY_BYTES, NO_ORDERING_KEY, RabbitMqTransport
from relay.webhooks import USER_AGENT

# The transport does not depend on the store: one backend is enough here.
sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def rabbit(
    exchange: str, routing_key: str = "orders.{ordering_key}", **options: object
) -> Destination:
    """A signed rabbitmq destination on the local broker."""
    return make_destination(
        AMQP_URL,
        kind="rabbitmq",
        exchange=exchange,
        routing_key=routing_key,
        secret=SECRET,
        **{"timeout": 5.0, **options},  # type: ignore[arg-type]
    )


@sqlite_only
def test_each_message_is_queued_with_its_bytes_id_headers_and_persistence(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    with Session(engine) as session, session.begin():
        publish(session, "default", "o-1", {"n": 1}, clock=clock, ordering_key="customer-7")
        publish(
            session,
            "default",
            "o-2",
            {"n": 2, "text": "é"},
            clock=clock,
            traceparent=TRACE,
            headers={"x-tenant": "acme"},
        )
    with topology(bindings=["orders.#"]) as made:
        with Relay(db_url, {"default": rabbit(made.exchange)}, clock=clock) as relay:
            assert sorted(relay.dispatch_once()) == [("o-1", "sent"), ("o-2", "sent")]
        queued = {m.message_id: m for m in take_all(made.queue)}
    stored = rows(engine)
    assert sorted(queued) == ["o-1", "o-2"]
    assert {r["state"] for r in stored.values()} == {"sent"}
    assert queued["o-1"].routing_key == "orders.customer-7"
    assert queued["o-2"].routing_key == f"orders.{NO_ORDERING_KEY}"
    for reply_id, message in queued.items():
        body = stored[reply_id]["body"]
        assert message.body == body
        assert message.delivery_mode == 2  # persistent
        assert message.content_type == "application/json"
        headers = {name: str(value) for name, value in message.headers.items()}
        assert verify([parse_secret(SECRET)], headers, message.body) == reply_id
        assert headers[CONTENT_HASH_HEADER] == hashlib.sha256(body).hexdigest()
        assert headers["user-agent"] == USER_AGENT
        expected = {"webhook-id", "webhook-timestamp", "webhook-signature", CONTENT_HASH_HEADER}
        expected |= {"user-agent"} | ({"traceparent", "x-tenant"} if reply_id == "o-2" else set())
        expected |= {ORDERING_KEY_HEADER} if reply_id == "o-1" else set()
        assert set(headers) == expected
    assert queued["o-2"].headers["traceparent"] == TRACE
    assert queued["o-2"].headers["x-tenant"] == "acme"
    assert queued["o-1"].headers[ORDERING_KEY_HEADER] == "customer-7"


@sqlite_only
def test_an_unroutable_message_is_dead_with_the_reason_and_the_rest_is_sent(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["u-1"], ordering_key="bound", clock=clock)
    publish_many(engine, ["u-2"], ordering_key="nobody", clock=clock)
    with topology(kind="direct", bindings=["orders.bound"]) as made:
        with Relay(db_url, {"default": rabbit(made.exchange)}, clock=clock) as relay:
            assert sorted(relay.dispatch_once()) == [("u-1", "sent"), ("u-2", "dead")]
            scraped = relay.metrics.render().decode()
        assert [m.message_id for m in take_all(made.queue)] == ["u-1"]
    dead = rows(engine)["u-2"]
    assert dead["last_error"] == (
        f"unroutable: no queue bound for exchange {made.exchange!r} routing key 'orders.nobody'"
    )
    assert dead["attempts"] == 1
    for line in (
        'outbox_relay_outcomes_total{destination="default",outcome="sent",status="none"} 1.0',
        'outbox_relay_outcomes_total{destination="default",outcome="dead",status="none"} 1.0',
        'outbox_relay_delivery_seconds_count{destination="default",mode="rabbitmq"} 1.0',
    ):
        assert line in scraped


@sqlite_only
def test_a_routing_key_longer_than_amqp_allows_is_dead(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["long-1"], ordering_key="k" * 200, clock=clock)
    publish_many(engine, ["short-1"], ordering_key="k", clock=clock)
    template = "x" * 60 + ".{ordering_key}"
    with topology(bindings=["#"]) as made:
        with Relay(db_url, {"default": rabbit(made.exchange, template)}, clock=clock) as relay:
            assert sorted(relay.dispatch_once()) == [("long-1", "dead"), ("short-1", "sent")]
        assert [m.message_id for m in take_all(made.queue)] == ["short-1"]
    error = rows(engine)["long-1"]["last_error"]
    assert error.startswith(f"routing key is 261 bytes, more than AMQP's {MAX_ROUTING_KEY_BYTES}")


@sqlite_only
def test_a_missing_exchange_stops_the_relay_at_start(db_url: str, engine: sa.Engine) -> None:
    with topology():  # the broker is reachable; this exchange is not declared
        missing = unique("missing")
        relay = Relay(db_url, {"default": rabbit(missing)})
        with relay, pytest.raises(ConfigError, match=f"exchange '{missing}' does not exist"):
            relay.run(install_signal_handlers=False)


@sqlite_only
def test_an_exchange_deleted_under_the_relay_makes_its_messages_dead(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["before"], clock=clock)
    with (
        topology() as made,
        Relay(db_url, {"default": rabbit(made.exchange)}, clock=clock) as relay,
    ):
        assert relay.dispatch_once() == [("before", "sent")]
        delete_exchange(made.exchange)
        publish_many(engine, ["after-1", "after-2"], clock=clock)
        assert sorted(relay.dispatch_once()) == [("after-1", "dead"), ("after-2", "dead")]
    error = rows(engine)["after-1"]["last_error"]
    assert error.startswith(f"exchange {made.exchange!r} does not exist on amqp://")
    assert "guest:guest" not in error


@sqlite_only
def test_a_nack_is_retried_and_delivered_later(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["n-1", "n-2"], clock=clock)
    # A queue that rejects publishes beyond one message: the broker nacks the second.
    full = {"x-max-length": 1, "x-overflow": "reject-publish"}
    with topology(queue_arguments=full) as made:
        destination = rabbit(made.exchange, concurrency=1, max_batch_items=1)
        with Relay(db_url, {"default": destination}, clock=clock, backoff=2) as relay:
            verdicts = dict(relay.dispatch_once())
            assert sorted(verdicts.values()) == ["retry", "sent"]
            [nacked] = [reply_id for reply_id, said in verdicts.items() if said == "retry"]
            assert rows(engine)[nacked]["last_error"] == "the broker nacked the message"
            first = take_all(made.queue)
            clock.advance(2)
            assert relay.dispatch_once() == [(nacked, "sent")]
        second = take_all(made.queue)
    assert sorted(m.message_id for m in first + second) == ["n-1", "n-2"]


@sqlite_only
def test_the_broker_keeps_no_duplicate_window_and_cannot_be_asked(
    db_url: str, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with topology() as made:
        destination = rabbit(made.exchange)
        with Relay(db_url, {"default": destination}) as relay:
            transport = relay.dispatcher.transport("default")
            assert transport.mode == "rabbitmq"
            assert relay._loop.run_until_complete(transport.retention()) is None
            publish_many(engine, ["h-1"])
            [message] = relay.leases.claim((), True)[0]
            assert relay._loop.run_until_complete(transport.holds(message)) is None
            with caplog.at_level(logging.WARNING, logger="outbox.relay"):
                relay._loop.run_until_complete(relay.check_retention())
        assert "publishes no receipt retention" in caplog.text
        strict = rabbit(made.exchange, require_retention=True)
        with (
            Relay(db_url, {"default": strict}) as relay,
            pytest.raises(ConfigError, match="require_retention is set"),
        ):
            relay._loop.run_until_complete(relay.check_retention())


@sqlite_only
def test_an_unreachable_broker_is_a_retry(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["down-1"], clock=clock)
    closed = make_destination(
        "amqp://guest:guest@127.0.0.1:1/",
        kind="rabbitmq",
        exchange="x",
        routing_key="k",
        unsigned=True,
        timeout=2,
    )
    with Relay(db_url, {"default": closed}, clock=clock) as relay:
        assert relay.dispatch_once() == [("down-1", "retry")]
    error = rows(engine)["down-1"]["last_error"]
    assert error.startswith("cannot connect: ")
    assert "guest:guest" not in error


def test_without_the_amqp_client_the_destination_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "aio_pika", None)  # import aio_pika raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'outbox-relay\[rabbitmq\]'"):
        RabbitMqTransport(rabbit("x"))


def test_close_without_a_connection_does_nothing() -> None:
    asyncio.run(RabbitMqTransport(rabbit("x")).close())


@sqlite_only
def test_requeue_cannot_ask_rabbitmq_and_needs_force(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("OUTBOX_CONFIG", "OUTBOX_RELAY_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for key, value in {
        "KIND": "rabbitmq",
        "URL": AMQP_URL,
        "EXCHANGE": "replies",
        "ROUTING_KEY": "r",
        "UNSIGNED": "true",
    }.items():
        monkeypatch.setenv(f"OUTBOX_DESTINATION_DEFAULT_{key}", value)
    publish_many(engine, ["gone-1"], clock=clock)
    with engine.begin() as conn:
        conn.execute(sa.update(messages).values(state="dead", last_error="unroutable: ..."))
    argv = ["dead", "requeue", "gone-1", "--reason", "queue bound now", "--db", db_url]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "destination 'default' is a RabbitMQ exchange: a queue cannot be asked" in err
    assert "--force to send it anyway" in err
    assert rows(engine)["gone-1"]["state"] == "dead"
    assert main([*argv, "--force"]) == 0
    assert rows(engine)["gone-1"]["state"] == "pending"


@sqlite_only
def test_a_keys_messages_are_queued_in_order_and_stop_at_the_first_nacked(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, [f"k-{n}" for n in range(1, 5)], ordering_key="K", clock=clock)
    # The queue takes two messages and rejects more: the broker nacks k-3, and k-4,
    # published only once k-3 is confirmed, is never published.
    full = {"x-max-length": 2, "x-overflow": "reject-publish"}
    with topology(queue_arguments=full) as made:
        destination = rabbit(made.exchange)
        with Relay(db_url, {"default": destination}, clock=clock, backoff=2) as relay:
            verdicts = dict(relay.dispatch_once())
            assert verdicts == {"k-1": "sent", "k-2": "sent", "k-3": "retry", "k-4": "retry"}
            stored = rows(engine)
            assert (stored["k-3"]["attempts"], stored["k-4"]["attempts"]) == (1, 0)
            first = take_all(made.queue)
            clock.advance(5)
            assert dict(relay.dispatch_once()) == {"k-3": "sent", "k-4": "sent"}
        second = take_all(made.queue)
    assert [m.message_id for m in first] == ["k-1", "k-2"]
    assert [m.message_id for m in second] == ["k-3", "k-4"]
    assert {m.headers[ORDERING_KEY_HEADER] for m in first + second} == {"K"}
