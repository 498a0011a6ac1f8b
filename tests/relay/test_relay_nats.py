"""NATS JetStream destinations against the real server: what the stream stores, and when.

Each test has a stream of its own on the shared server (deleted after); the relay
delivers through it as it would in production, and the test reads back what the
stream holds: the exact body, every header, one copy per reply_id.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.nats_helpers import (
    NATS_URL,
    NatsServer,
    Stream,
    new_stream,
    require_nats,
    stream_of_this_test,
    with_jetstream,
)
from support.receiver_helpers import free_port
from support.relay_helpers import SECRET, publish_many, rows

import outbox
from outbox.schema import messages as outbox_messages
from outbox.signing import (
    CONTENT_HASH_HEADER,
    ORDERING_KEY_HEADER,
    broker_message_id,
    parse_secret,
    verify,
)
from outbox.testing import ManualClock
from relay import ConfigError, Destination, Relay, make_destination
from relay.policy import Dead, Retry, Sent
from relay.records import Message
from relay.transports.base import Parcel
from relay.transports.nats import NatsTransport
from relay.transports.nats_wire import render_subject, subject_matches, subject_token

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def stream() -> Iterator[Stream]:
    """A stream of this test's own on the shared server, deleted after."""
    require_nats()
    with stream_of_this_test() as created:
        yield created


@pytest.fixture(params=[True, False], ids=["fast-client", "nats-py-client"])
def fast_client(request: pytest.FixtureRequest) -> bool:
    """The destination's fast_client: the relay's own client, or nats-py's public publish;
    each gives the same stored messages, PubAcks and order."""
    return bool(request.param)


def nats_destination(stream: Stream, subject: str | None = None, **options: Any) -> Destination:
    """A signed destination publishing into `stream`, on `<prefix>.{ordering_key}` by default."""
    return make_destination(
        NATS_URL,
        kind="nats",
        stream=stream.name,
        subject=subject or f"{stream.prefix}.{{ordering_key}}",
        secret=SECRET,
        timeout=5,
        **options,
    )


def drain(relay: Relay, turns: int = 50) -> dict[str, str]:
    """dispatch_once until a turn claims nothing: the last verdict of each reply_id."""
    verdicts: dict[str, str] = {}
    for _ in range(turns):
        done = relay.dispatch_once()
        if not done:
            return verdicts
        verdicts.update(done)
    raise AssertionError(f"still claiming after {turns} turns: {verdicts}")


@pytest.mark.parametrize(
    ("key", "token"),
    [
        (None, "_"),
        ("_", "%5F"),
        ("order-17", "order-17"),
        ("a.b", "a%2Eb"),
        ("two words", "two%20words"),
        ("*>", "%2A%3E"),
        ("100%", "100%25"),
        ("%2E", "%252E"),
        ("tab\there", "tab%09here"),
        ("é", "%C3%A9"),
    ],
)
def test_an_ordering_key_becomes_one_subject_token(key: str | None, token: str) -> None:
    assert subject_token(key) == token
    assert render_subject("orders.{ordering_key}.v1", key) == f"orders.{token}.v1"


def test_distinct_keys_never_share_a_token() -> None:
    keys = [None, "_", "%5F", "a.b", "a%2Eb", "a b", "a%20b", "*", "%2A"]
    assert len({subject_token(k) for k in keys}) == len(keys)


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("orders.>", "orders._", True),
        ("orders.>", "orders.a.b", True),
        ("orders.>", "orders", False),
        ("orders.*", "orders.a", True),
        ("orders.*", "orders.a.b", False),
        ("orders.a", "orders.a", True),
        ("orders.a", "orders.b", False),
        ("*.a", "x.a", True),
        (">", "anything.at.all", True),
    ],
)
def test_a_stream_filter_captures_subjects_as_nats_does(
    pattern: str, subject: str, matches: bool
) -> None:
    assert subject_matches(pattern, subject) is matches


def test_each_message_is_stored_once_with_its_exact_body_and_every_header(
    db_url: str, engine: sa.Engine, clock: ManualClock, stream: Stream, fast_client: bool
) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(
            session, "default", "r-1", {"n": 1, "text": "é"}, ordering_key="k.1", clock=clock
        )
        outbox.publish(session, "default", "r-2", [1, 2], traceparent=TRACEPARENT, clock=clock)
    destination = nats_destination(stream, fast_client=fast_client)
    with Relay(db_url, {"default": destination}, clock=clock) as relay:
        assert dict(relay.dispatch_once()) == {"r-1": "sent", "r-2": "sent"}
    stored = {m.headers["webhook-id"]: m for m in stream.stored()}
    assert sorted(stored) == ["r-1", "r-2"]
    saved = rows(engine)
    keys = [parse_secret(SECRET)]
    for reply_id, subject in (("r-1", f"{stream.prefix}.k%2E1"), ("r-2", f"{stream.prefix}._")):
        message, row = stored[reply_id], saved[reply_id]
        assert message.subject == subject
        assert message.data == bytes(row["body"])
        assert verify(keys, message.headers, message.data) == reply_id
        digest = hashlib.sha256(message.data).hexdigest()
        expected = {
            # Derived with the secret: nobody without it can take the id first.
            "Nats-Msg-Id": broker_message_id(SECRET, reply_id),
            "Nats-Expected-Stream": stream.name,
            "webhook-id": reply_id,
            "webhook-timestamp": message.headers["webhook-timestamp"],
            "webhook-signature": message.headers["webhook-signature"],
            "content-type": "application/json",
            "user-agent": message.headers["user-agent"],
            CONTENT_HASH_HEADER: digest,
        }
        if reply_id == "r-2":
            expected["traceparent"] = TRACEPARENT
        if row["ordering_key"] is not None:
            expected[ORDERING_KEY_HEADER] = row["ordering_key"]
        assert message.headers == expected
        assert row["content_hash"] == digest
        assert row["state"] == "sent"


def test_a_republished_reply_id_is_dropped_by_the_stream_and_counts_as_sent(
    db_url: str, engine: sa.Engine, clock: ManualClock, stream: Stream, fast_client: bool
) -> None:
    publish_many(engine, ["r-1"], clock=clock)
    destination = nats_destination(stream, fast_client=fast_client)
    with Relay(db_url, {"default": destination}, clock=clock) as relay:
        assert relay.dispatch_once() == [("r-1", "sent")]
    row = rows(engine)["r-1"]
    message = Message(
        row["id"], "r-1", "default", bytes(row["body"]), row["content_hash"], {}, 2, 1
    )
    transport = NatsTransport(destination)

    async def again() -> dict[int, Any]:
        try:
            return await transport.send(Parcel([message]))
        finally:
            await transport.close()

    assert asyncio.run(again()) == {row["id"]: Sent(None)}
    assert [m.headers["webhook-id"] for m in stream.stored()] == ["r-1"]


def test_a_message_given_twice_in_a_parcel_is_answered_without_waiting_out_the_deadline(
    stream: Stream,
) -> None:
    message = Message(7, "r-7", "default", b"{}", hashlib.sha256(b"{}").hexdigest(), {}, 1, 1)
    transport = NatsTransport(nats_destination(stream))

    async def twice() -> tuple[dict[int, Any], bool]:
        try:
            outcomes = await transport.send(Parcel([message, message]))
            assert transport._link is not None
            # Waiting for a second PubAck that never comes would end at the deadline,
            # which marks the link lost.
            return outcomes, transport._link.lost.is_set()
        finally:
            await transport.close()

    assert asyncio.run(twice()) == ({7: Sent(None)}, False)
    assert [m.headers["webhook-id"] for m in stream.stored()] == ["r-7"]


@pytest.mark.parametrize("client", ["relay", "nats-py", "fallback"])
def test_pub_acks_settle_a_parcel_through_either_client(
    stream: Stream, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nats-py's own client, chosen (fast_client = false) or as a nats-py release the relay
    # does not know would give (the fast client's check falls back to it): PubAcks then
    # come through its subscription queue instead of straight from its parser.
    import nats

    if client == "fallback":
        monkeypatch.setattr("relay.transports.nats.relay_client", lambda _: nats.aio.client.Client)
    messages = [
        Message(n, f"r-{n}", "default", b"{}", hashlib.sha256(b"{}").hexdigest(), {}, 1, 1)
        for n in range(1, 4)
    ]
    transport = NatsTransport(nats_destination(stream, fast_client=client != "nats-py"))

    async def publish() -> tuple[dict[int, Any], int]:
        try:
            outcomes = await transport.send(Parcel(messages))
            assert transport._link is not None
            # What went through nats-py's subscription (its count of messages it queued).
            queued = sum(sub._received for sub in transport._link.client._subs.values())
            return outcomes, queued
        finally:
            await transport.close()

    outcomes, queued = asyncio.run(publish())
    assert outcomes == dict.fromkeys((1, 2, 3), Sent(None))
    assert queued == (0 if client == "relay" else 3)
    assert sorted(m.headers["webhook-id"] for m in stream.stored()) == ["r-1", "r-2", "r-3"]


def test_a_publish_that_fails_leaves_each_message_of_the_parcel_a_retry(
    stream: Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nats

    async def refuse(client: Any, publishes: Any) -> None:
        raise nats.errors.ConnectionClosedError

    monkeypatch.setattr("relay.transports.nats.publish_all", refuse)
    messages = [
        Message(n, f"r-{n}", "default", b"{}", hashlib.sha256(b"{}").hexdigest(), {}, 1, 1)
        for n in (1, 2)
    ]
    transport = NatsTransport(nats_destination(stream))

    async def publish() -> dict[int, Any]:
        try:
            return await transport.send(Parcel(messages))
        finally:
            await transport.close()

    outcomes = asyncio.run(publish())
    assert set(outcomes) == {1, 2}
    for outcome in outcomes.values():
        assert type(outcome) is Retry
        assert outcome.error.startswith("NATS publish failed: ConnectionClosedError")
    assert stream.stored() == []


def test_messages_of_each_key_are_stored_in_publish_order(
    db_url: str, engine: sa.Engine, clock: ManualClock, stream: Stream, fast_client: bool
) -> None:
    keys = ["a", "b.c", "d e"]
    with Session(engine) as session, session.begin():
        for n in range(8):
            for k, key in enumerate(keys):
                outbox.publish(
                    session, "default", f"k{k}-{n}", {"n": n}, ordering_key=key, clock=clock
                )
    with Relay(
        db_url,
        {"default": nats_destination(stream, fast_client=fast_client)},
        clock=clock,
        batch=100,
    ) as relay:
        verdicts = drain(relay)
    assert set(verdicts.values()) == {"sent"}
    stored = stream.stored()
    assert len(stored) == 8 * len(keys)
    for k, key in enumerate(keys):
        of_key = [m for m in stored if m.subject == f"{stream.prefix}.{subject_token(key)}"]
        assert [m.headers["webhook-id"] for m in of_key] == [f"k{k}-{n}" for n in range(8)]


def test_a_duplicate_window_shorter_than_the_retry_window_is_refused_unless_allowed(
    db_url: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    require_nats()
    with stream_of_this_test(duplicate_window=60) as short:
        relay = Relay(db_url, {"default": nats_destination(short)}, clock=clock)
        try:
            refused = (
                r"duplicate window of 1m, shorter than .* at least \S+ \(`outbox broker setup`"
            )
            with pytest.raises(ConfigError, match=refused):
                relay.run(install_signal_handlers=False)
        finally:
            relay.close()
        allowed = nats_destination(short, allow_short_retention=True)
        with caplog.at_level(logging.WARNING), Relay(db_url, {"default": allowed}) as relay:
            relay._loop.run_until_complete(relay.check_retention())
        assert any("allow_short_retention is set" in r.getMessage() for r in caplog.records)
    with (
        stream_of_this_test(duplicate_window=3600) as long,
        Relay(db_url, {"default": nats_destination(long)}) as relay,
    ):
        relay._loop.run_until_complete(relay.check_retention())  # accepted: no error


def test_a_missing_stream_or_a_subject_it_does_not_capture_is_refused_at_start(
    db_url: str, stream: Stream
) -> None:
    missing = make_destination(
        NATS_URL, kind="nats", stream=stream.name + "_NONE", subject="x.y", secret=SECRET
    )
    with (
        Relay(db_url, {"default": missing}) as relay,
        pytest.raises(ConfigError, match=r"stream 'OUTBOX_T_\w+_NONE' does not exist"),
    ):
        relay._loop.run_until_complete(relay.check_retention())
    elsewhere = nats_destination(stream, subject="elsewhere.{ordering_key}")
    with (
        Relay(db_url, {"default": elsewhere}) as relay,
        pytest.raises(
            ConfigError, match=r"does not capture the subject 'elsewhere.{ordering_key}'"
        ),
    ):
        relay._loop.run_until_complete(relay.check_retention())


def test_a_message_over_the_streams_size_limit_is_dead_and_no_stream_is_a_retry(
    db_url: str, engine: sa.Engine, clock: ManualClock, stream: Stream
) -> None:
    with_jetstream(
        NATS_URL,
        lambda js: js.update_stream(
            name=stream.name, subjects=[stream.subjects], max_msg_size=64, duplicate_window=3600
        ),
    )
    with Session(engine) as session, session.begin():
        outbox.publish(session, "big", "r-big", {"text": "x" * 200}, clock=clock)
        outbox.publish(session, "nowhere", "r-nowhere", {"n": 1}, clock=clock)
    destinations = {
        "big": nats_destination(stream),
        "nowhere": nats_destination(stream, subject="nobody.listens.{ordering_key}"),
    }
    with Relay(db_url, destinations, clock=clock) as relay:
        assert dict(relay.dispatch_once()) == {"r-big": "dead", "r-nowhere": "retry"}
    saved = rows(engine)
    assert "JetStream refused the message" in saved["r-big"]["last_error"]
    assert "exceeds maximum" in saved["r-big"]["last_error"]
    assert "no JetStream stream answered" in saved["r-nowhere"]["last_error"]
    assert stream.stored() == []


def test_a_subject_bound_to_another_stream_is_dead(
    db_url: str, engine: sa.Engine, clock: ManualClock, stream: Stream
) -> None:
    require_nats()
    with stream_of_this_test() as other:
        publish_many(engine, ["r-1"], clock=clock)
        wrong = nats_destination(stream, subject=f"{other.prefix}.{{ordering_key}}")
        with Relay(db_url, {"default": wrong}, clock=clock) as relay:
            assert relay.dispatch_once() == [("r-1", "dead")]
        assert "expected stream does not match" in rows(engine)["r-1"]["last_error"]
        assert other.stored() == []


def test_an_unreachable_server_is_a_retry(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["r-1"], clock=clock)
    nowhere = make_destination(
        f"nats://127.0.0.1:{free_port()}",
        kind="nats",
        stream="S",
        subject="s.{ordering_key}",
        secret=SECRET,
        timeout=1,
    )
    with Relay(db_url, {"default": nowhere}, clock=clock) as relay:
        assert relay.dispatch_once() == [("r-1", "retry")]
    assert "cannot connect to NATS" in rows(engine)["r-1"]["last_error"]


def test_a_publish_nobody_acknowledges_is_a_retry_for_each_message_of_its_parcel() -> None:
    require_nats()
    import nats

    # A plain subscriber takes the subject and never answers: no PubAck ever comes.
    silent = f"silent{uuid.uuid4().hex[:12]}"
    destination = make_destination(
        NATS_URL, kind="nats", stream="NONE", subject=f"{silent}.x", unsigned=True, timeout=0.5
    )
    messages = [Message(n, f"r-{n}", "default", b"{}", "0" * 64, {}, 1, 1) for n in (1, 2)]

    async def scenario() -> dict[int, Any]:
        listener = await nats.connect(NATS_URL)
        await listener.subscribe(f"{silent}.>")
        transport = NatsTransport(destination)
        try:
            return await transport.send(Parcel(messages))
        finally:
            await transport.close()
            await listener.close()

    assert asyncio.run(scenario()) == dict.fromkeys((1, 2), Retry(None, "no PubAck within 0.5s"))


def test_a_message_header_cannot_switch_off_the_streams_dedupe(
    db_url: str, engine: sa.Engine, clock: ManualClock, stream: Stream
) -> None:
    publish_many(engine, ["r-1"], clock=clock)
    # A stored row from before publish() refused Nats-* names, and a value holding the text.
    with engine.begin() as conn:
        conn.execute(
            sa.update(outbox_messages).values(headers='{"x-note": "see Nats-Msg-Id: other"}')
        )
    destination = nats_destination(stream)
    with Relay(db_url, {"default": destination}, clock=clock) as relay:
        assert relay.dispatch_once() == [("r-1", "sent")]
    row = rows(engine)["r-1"]
    message = Message(
        row["id"],
        "r-1",
        "default",
        bytes(row["body"]),
        row["content_hash"],
        {"x-note": "see Nats-Msg-Id: other"},
        2,
        1,
    )
    reserved = message._replace(id=row["id"] + 1, headers={"Nats-Rollup": "all"})
    transport = NatsTransport(destination)

    async def again() -> dict[int, Any]:
        try:
            return await transport.send(Parcel([message, reserved]))
        finally:
            await transport.close()

    outcomes = asyncio.run(again())
    assert outcomes[row["id"]] == Sent(None)
    assert outcomes[row["id"] + 1] == Dead(None, "header 'Nats-Rollup' is reserved for NATS")
    assert [m.headers["webhook-id"] for m in stream.stored()] == ["r-1"]  # deduped


def test_publish_refuses_header_names_jetstream_would_act_on(engine: sa.Engine) -> None:
    with Session(engine) as session, pytest.raises(outbox.InvalidMessage, match="NATS"):
        outbox.publish(session, "default", "r-1", {}, headers={"Nats-Msg-Id": "other"})


FAKE_INFO = (
    b'INFO {"server_id":"FAKE","version":"2.9.0","proto":1,"headers":true,'
    b'"max_payload":1048576}\r\n'
)


@asynccontextmanager
async def slow_nats(info_after: float | None) -> AsyncIterator[str]:
    """A server that greets after `info_after` seconds (None: never), answers PINGs, and
    otherwise reads everything and answers nothing: no PubAck ever comes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if info_after is not None:
                await asyncio.sleep(info_after)  # the slow server, not a wait for an event
                writer.write(FAKE_INFO)
            while line := await reader.readline():
                if info_after is not None and line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.parametrize("info_after", [1.5, None], ids=["slow-greeting", "silent"])
def test_an_attempt_ends_within_its_timeout_however_slow_the_server(
    info_after: float | None,
) -> None:
    # The server never acknowledges: only the attempt's own deadline can end it. One
    # deadline for the whole attempt ends it at `timeout`; a deadline per step (greeting,
    # then PubAck) would end it no sooner than `info_after + timeout`, 1.5 s later: that
    # is the event the attempt must come before, a margin no scheduling delay reaches.
    timeout = 2.0
    messages = [Message(n, f"r-{n}", "default", b"{}", "0" * 64, {}, 1, 1) for n in (1, 2)]

    async def scenario() -> tuple[dict[int, Any], float]:
        async with slow_nats(info_after) as url:
            destination = make_destination(
                url, kind="nats", stream="S", subject="s.x", unsigned=True, timeout=timeout
            )
            transport = NatsTransport(destination)
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                # Far beyond the timeout: reached only by an attempt its deadline missed.
                outcomes = await asyncio.wait_for(transport.send(Parcel(messages)), 60)
                return outcomes, loop.time() - started
            finally:
                await transport.close()

    outcomes, took = asyncio.run(scenario())
    if info_after is not None:
        assert took < info_after + timeout, f"the attempt took {took:.2f}s: a deadline per step"
    assert set(outcomes) == {1, 2}
    assert all(isinstance(outcome, Retry) for outcome in outcomes.values()), outcomes


@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed"])
def test_a_short_window_found_after_the_start_check_failed_stops_publishing_unless_allowed(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    allowed: bool,
) -> None:
    server = NatsServer(tmp_path)  # not started: the start check cannot reach it
    short = new_stream(server.url, duplicate_window=60)
    destination = make_destination(
        server.url,
        kind="nats",
        stream=short.name,
        subject=f"{short.prefix}.{{ordering_key}}",
        secret=SECRET,
        timeout=5,
        allow_short_retention=allowed,
    )
    ids = ["r-1", "r-2"]
    publish_many(engine, ids, clock=clock)
    with Relay(db_url, {"default": destination}, clock=clock) as relay:
        with caplog.at_level(logging.WARNING):
            relay._loop.run_until_complete(relay.check_retention())  # a warning only
        assert any("retention not checked" in r.getMessage() for r in caplog.records)
        server.start()
        try:
            assert dict(relay.dispatch_once()) == dict.fromkeys(ids, "retry")  # no stream yet
            for row in rows(engine).values():
                assert "does not exist" in row["last_error"]
                assert "nothing is published until that is fixed" in row["last_error"]
            short.create()
            clock.advance(3600)
            with caplog.at_level(logging.WARNING):
                verdicts = dict(relay.dispatch_once())
            if allowed:
                assert verdicts == dict.fromkeys(ids, "sent")
                assert any("allow_short_retention is set" in r.getMessage() for r in caplog.records)
                assert sorted(m.headers["webhook-id"] for m in short.stored()) == ids
                return
            assert verdicts == dict.fromkeys(ids, "retry")
            for row in rows(engine).values():
                error = row["last_error"]
                assert "duplicate window of 1m, shorter than the longest retry" in error
                assert "`outbox broker setup` creates or updates the stream" in error
                assert "allow_short_retention" in error
            assert any(
                r.levelno == logging.ERROR and "duplicate window of 1m" in r.getMessage()
                for r in caplog.records
            )
            assert short.stored() == []
            # The operator lengthens the window: the next attempt publishes.
            with_jetstream(
                server.url,
                lambda js: js.update_stream(
                    name=short.name, subjects=[short.subjects], duplicate_window=3600
                ),
            )
            clock.advance(3600)
            assert dict(relay.dispatch_once()) == dict.fromkeys(ids, "sent")
            assert sorted(m.headers["webhook-id"] for m in short.stored()) == ids
        finally:
            server.kill()


def test_a_keys_messages_are_stored_in_order_and_stop_at_the_first_refused(
    db_url: str, engine: sa.Engine, clock: ManualClock, stream: Stream, fast_client: bool
) -> None:
    from nats.js.api import DiscardPolicy

    # The stream takes two messages, then refuses new ones (a retry): k-3 is refused,
    # and k-4, published only after k-3's PubAck, is never published.
    async def limit(js: Any) -> None:
        info = await js.stream_info(stream.name)
        config = info.config
        config.max_msgs = 2
        config.discard = DiscardPolicy.NEW
        await js.update_stream(config)

    with_jetstream(stream.url, limit)
    publish_many(engine, [f"k-{n}" for n in range(1, 5)], ordering_key="K", clock=clock)
    with Relay(
        db_url, {"default": nats_destination(stream, fast_client=fast_client)}, clock=clock
    ) as relay:
        verdicts = dict(relay.dispatch_once())
    assert verdicts == {"k-1": "sent", "k-2": "sent", "k-3": "retry", "k-4": "retry"}
    stored = stream.stored()
    assert [m.headers["webhook-id"] for m in stored] == ["k-1", "k-2"]
    assert {m.headers["outbox-ordering-key"] for m in stored} == {"K"}
    row = rows(engine)
    assert (row["k-3"]["attempts"], row["k-4"]["attempts"]) == (1, 0)
    assert row["k-4"]["last_error"].startswith("not attempted")
