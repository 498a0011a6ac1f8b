"""What a relay does when the turn outlasts the lease, a batch is too big, a peer is hostile,
or the database refuses a settle: nothing sent twice while a lease holds, nothing lost."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection

import pytest
import sqlalchemy as sa
from support.raw_peer import RawPeer
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

from outbox.redaction import redact_urls
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay import http_client as relay_http
from relay.records import Message
from relay.transports import http as http_module
from relay.transports.http import pack_batches


def test_no_attempt_starts_that_could_outlive_the_lease(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    ids = [f"slow-{n}" for n in range(6)]
    publish_many(engine, ids, clock=clock)
    # Each answer takes at least 1 s, one at a time: the turn's lease (5 s, less its 0.5 s
    # margin) leaves room to start an attempt of 2 s for 2.5 s, so for three at the very
    # most, and a slow machine only makes that fewer. The 1 s left in each attempt's
    # timeout is room for that slowness: every attempt started is answered.
    server.default = Answer(stall=1.0)
    one_at_a_time = make_destination(server.url, secret=SECRET, timeout=2, concurrency=1)
    with Relay(db_url, {"default": one_at_a_time}, clock=clock, lease=5) as relay:
        verdicts = dict(relay.dispatch_once())
    sent = [i for i, v in verdicts.items() if v == "sent"]
    assert 1 <= len(sent) <= 3
    assert sorted(server.ids()) == sorted(sent)  # the rest were never started
    stored = rows(engine)
    for reply_id in set(ids) - set(sent):
        assert verdicts[reply_id] == "retry"
        assert (stored[reply_id]["state"], stored[reply_id]["attempts"]) == ("pending", 0)


def message(ident: int, body: bytes) -> Message:
    return Message(ident, f"r-{ident}", "default", body, "", {}, 1, 1)


def test_batches_respect_item_and_byte_limits() -> None:
    messages = [message(n, b'{"x":"' + b"y" * 100 + b'"}') for n in range(10)]
    by_items = pack_batches(messages, max_items=3, max_bytes=1_000_000)
    assert [len(group) for group, _ in by_items] == [3, 3, 3, 1]
    by_bytes = pack_batches(messages, max_items=100, max_bytes=400)
    assert all(len(body) <= 400 for _, body in by_bytes)
    assert [m.id for group, _ in by_bytes for m in group] == list(range(10))
    [(alone, body)] = pack_batches([message(1, b'"' + b"z" * 900 + b'"')], 100, 400)
    assert len(alone) == 1  # one reply too big still goes, alone
    assert len(body) > 400


def test_no_messages_make_no_batch() -> None:
    # A parcel whose keys all stopped leaves nothing to send: no empty batch request.
    assert pack_batches([], max_items=10, max_bytes=10_000) == []
    assert http_module._packed_by_item([], 10, 10_000) == []


def test_a_batch_packed_whole_is_the_body_packed_item_by_item() -> None:
    bodies = [b'"\\u00e9 \\" \xc3\xa9 \xe2\x80\xa8"', b'{"a":[1,2.5,null]}', b'"\\n\\t\\u0001"']
    messages = [message(n, body) for n, body in enumerate(bodies)]
    messages.append(message(3, b"{}")._replace(ordering_key="k", headers={"traceparent": "t-1"}))
    whole = pack_batches(messages, max_items=10, max_bytes=10_000)
    assert whole == http_module._packed_by_item(messages, 10, 10_000)
    [(group, body)] = whole
    assert group == messages
    assert json.loads(body)["replies"][3] == {
        "reply_id": "r-3",
        "body": "{}",
        "ordering_key": "k",
        "headers": {"traceparent": "t-1"},
    }
    assert [item["body"].encode() for item in json.loads(body)["replies"][:3]] == bodies


def test_a_refused_whole_batch_retries_but_a_refused_single_reply_is_dead(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["b-1", "b-2", "b-3"], clock=clock)
    server.default = Answer(status=413)
    batched = make_destination(
        server.url, secret=SECRET, timeout=2, mode="batch", batch_url=server.url
    )
    with Relay(db_url, {"default": batched}, clock=clock, backoff=1) as relay:
        assert sorted(relay.dispatch_once()) == [
            ("b-1", "retry"),
            ("b-2", "retry"),
            ("b-3", "retry"),
        ]
    assert "whole batch of 3 refused" in rows(engine)["b-1"]["last_error"]
    clock.advance(1)
    alone = make_destination(
        server.url, secret=SECRET, timeout=2, mode="batch", batch_url=server.url, max_batch_items=1
    )
    with Relay(db_url, {"default": alone}, clock=clock) as relay:
        assert sorted(relay.dispatch_once()) == [(i, "dead") for i in ("b-1", "b-2", "b-3")]


def test_a_hostile_error_body_is_stored_printable(
    db_url: str, engine: sa.Engine, server: ScriptedServer, clock: ManualClock
) -> None:
    publish_many(engine, ["h-1", "h-2"], clock=clock)
    server.script("h-1", Answer(status=500, body=b"bad\x00\x1b[31mred\x07"))
    destination = make_destination(server.url, secret=SECRET, timeout=2)
    with Relay(db_url, {"default": destination}, clock=clock) as relay:
        assert sorted(relay.dispatch_once()) == [("h-1", "retry"), ("h-2", "sent")]
    error = rows(engine)["h-1"]["last_error"]
    assert error.isprintable()
    assert "bad" in error


def test_outcomes_survive_a_failed_settle_and_are_recorded_next_turn(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish_many(engine, ["s-1"], clock=clock)
    destination = make_destination(server.url, secret=SECRET, timeout=2)
    with Relay(db_url, {"default": destination}, clock=clock) as relay:
        real_settle = relay.leases._settle

        def refuse_once(*args: object, **kwargs: object) -> set[int]:
            monkeypatch.setattr(relay.leases, "_settle", real_settle)
            raise RuntimeError("database said no")

        monkeypatch.setattr(relay.leases, "_settle", refuse_once)
        with pytest.raises(RuntimeError, match="database said no"):
            relay.dispatch_once()
        assert rows(engine)["s-1"]["state"] == "sending"
        assert relay.dispatch_once() == []  # records the kept outcome, claims nothing new
    row = rows(engine)["s-1"]
    assert (row["state"], row["attempts"]) == ("sent", 1)
    assert server.ids() == ["s-1"]  # known outcome: never sent again


def test_rows_a_failed_looking_claim_leased_are_adopted_not_left_to_expire(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish_many(engine, ["o-1", "o-2"], clock=clock)
    with Relay(
        db_url, {"default": make_destination(server.url, secret=SECRET)}, clock=clock
    ) as relay:
        real_claim_rows = relay.leases._claim_rows

        def commit_then_lose_the_answer(busy: Collection[str], may_adopt: bool) -> list[object]:
            monkeypatch.setattr(relay.leases, "_claim_rows", real_claim_rows)
            real_claim_rows(busy, may_adopt)  # committed: the rows are 'sending' under this relay
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection lost"), True)

        monkeypatch.setattr(relay.leases, "_claim_rows", commit_then_lose_the_answer)
        assert sorted(relay.dispatch_once()) == [("o-1", "sent"), ("o-2", "sent")]
    stored = rows(engine)
    assert [(r["state"], r["attempts"]) for r in stored.values()] == [("sent", 1), ("sent", 1)]
    assert sorted(server.ids()) == ["o-1", "o-2"]


def test_relays_without_an_owner_name_get_distinct_ones(
    db_url: str, server: ScriptedServer
) -> None:
    destination = {"default": make_destination(server.url, secret=SECRET)}
    with Relay(db_url, destination) as first, Relay(db_url, destination) as second:
        assert first.owner != second.owner
        assert first.owner.startswith("relay-")


def test_an_answer_over_the_size_limit_is_a_transport_error(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay_http, "MAX_ANSWER_BYTES", 4096)
    publish_many(engine, ["small", "huge"], clock=clock)
    server.script("small", Answer(body=b"x" * 4096))
    server.script("huge", Answer(body=b"x" * 4097))
    target = make_destination(server.url, secret=SECRET, timeout=5)
    with Relay(db_url, {"default": target}, clock=clock) as relay:
        verdicts = dict(relay.dispatch_once())
    assert verdicts == {"small": "sent", "huge": "retry"}
    assert "answer larger than 4096 bytes" in rows(engine)["huge"]["last_error"]


def test_a_token_in_the_destination_url_never_reaches_stored_errors_or_logs(
    db_url: str,
    engine: sa.Engine,
    peer: RawPeer,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    publish_many(engine, ["t-1"], clock=clock)
    peer.answers = {"POST": b"garbage\r\n\r\n"}
    secret_url = peer.url + "?token=s3cret-token"
    destination = make_destination(secret_url, secret=SECRET, timeout=2)
    with (
        caplog.at_level(logging.DEBUG),
        Relay(db_url, {"default": destination}, clock=clock) as relay,
    ):
        assert relay.dispatch_once() == [("t-1", "retry")]
    error = rows(engine)["t-1"]["last_error"]
    assert "Bad status line" in error
    assert "?<redacted>" in error
    assert "s3cret-token" not in error
    assert "s3cret-token" not in caplog.text


def test_urls_lose_their_credentials_and_query_strings() -> None:
    text = "failed: url='https://user:pw@h.example:8443/a/b?token=x&y=2#frag' and http://ok/x"
    assert redact_urls(text) == (
        "failed: url='https://user:<redacted>@h.example:8443/a/b?<redacted>' and http://ok/x"
    )
