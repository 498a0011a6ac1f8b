"""Nothing a destination sends can raise out of delivery: every claimed message is settled.

A raw TCP peer answers each request with bytes Hypothesis draws (status line, headers,
body), for single POSTs, batch POSTs and receipt lookups, and each turn must settle
every message it claimed: none is left `sending` for its lease to run out.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import fuzz
from support.raw_peer import RawPeer
from support.relay_helpers import SECRET, publish_many, rows

from outbox.schema import messages
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.policy import parse_retry_after

LEASE = 10.0


HEADER_NAMES = [
    b"Retry-After",
    b"Content-Length",
    b"Content-Type",
    b"Transfer-Encoding",
    b"Connection",
    b"Content-Encoding",
]
HEADER_VALUES = [
    b"1",
    b"0",
    b"-1",
    b"1e400",
    b"\xc2\xb2",
    b"\xd9\xa3",
    b"99999999999999999999999",
    b"Wed, 21 Oct 2015 07:28:00 GMT",
    b"Mon, 32 Foo 99999 99:99:99 +9999",
    b"Tue, 01 Jan 0001 00:00:00 GMT",
    b"chunked",
    b"gzip",
    b"application/json",
    b"close",
]
# Mostly the statuses and values that steer the relay into each parsing path (a 2xx
# batch answer, a 200 lookup, a retryable status with its Retry-After), some raw bytes.
STATUS_LINES = st.one_of(
    st.builds(
        lambda code, reason: b"HTTP/1.1 %d %s\r\n" % (code, reason),
        st.one_of(
            st.sampled_from([200, 200, 201, 429, 503, 404, 409, 301, 150, 0, 999]),
            st.integers(0, 1200),
        ),
        st.sampled_from([b"OK", b"", b"\xff\xfe", b"x" * 300]),
    ),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"") + b"\r\n"),
)
HEADERS = st.lists(
    st.tuples(
        st.one_of(st.just(b"Retry-After"), st.sampled_from(HEADER_NAMES), st.binary(max_size=8)),
        st.one_of(st.sampled_from(HEADER_VALUES), st.binary(max_size=24)),
    ),
    max_size=3,
)


ITEM_STATUSES = st.one_of(
    st.sampled_from(["stored", "duplicate", "conflict", "invalid", "STORED", ""]),
    st.none(),
    st.integers(),
    st.lists(st.integers(), max_size=2),
)


def _bodies(ids: list[str]) -> st.SearchStrategy[bytes]:
    """Bodies a batch, single or lookup answer may hold, some shaped like the real ones."""
    some_id = st.one_of(st.sampled_from(ids), st.text(max_size=5), st.integers(), st.none())
    item = st.one_of(
        st.fixed_dictionaries({"reply_id": some_id, "status": ITEM_STATUSES}),
        st.dictionaries(st.text(max_size=8), st.integers(), max_size=2),
        st.integers(),
        st.text(max_size=5),
    )
    shaped = st.one_of(
        st.fixed_dictionaries({"results": st.lists(item, max_size=5)}),
        st.fixed_dictionaries({"results": st.one_of(st.integers(), st.text(), st.none())}),
        st.fixed_dictionaries(
            {"content_hash": st.one_of(st.text(max_size=8), st.integers(), st.none())}
        ),
        st.lists(st.integers(), max_size=3),
    ).map(lambda value: json.dumps(value).encode())
    return st.one_of(
        st.sampled_from(
            [
                b"[" * 100_000 + b"]" * 100_000,
                b'{"results":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                b'{"results":[{"reply_id":"x","status":"stored"}' + b"," * 10,
                b'{"content_hash":' + b"9" * 5000 + b"}",
                b'{"results":[{"reply_id":1e400,"status":"stored"}]}',
                b"\xff\xfe\x00",
            ]
        ),
        shaped,
        st.binary(max_size=64),
    )


def _answer(data: st.DataObject, ids: list[str]) -> bytes:
    status = data.draw(STATUS_LINES)
    headers = b"".join(name + b": " + value + b"\r\n" for name, value in data.draw(HEADERS))
    body = data.draw(_bodies(ids))
    if data.draw(st.booleans()):
        headers += b"Content-Length: %d\r\n" % len(body)
    return status + headers + b"\r\n" + body


@pytest.mark.parametrize("mode", ["single", "batch"])
def test_no_answer_can_leave_a_claimed_message_unsettled(
    db_url: str, engine: sa.Engine, peer: RawPeer, clock: ManualClock, mode: str
) -> None:
    destination = make_destination(
        peer.url, secret=SECRET, timeout=2, mode=mode, receipt_lookup=True
    )
    options: dict[str, Any] = {"clock": clock, "lease": LEASE, "max_attempts": 1}
    with (
        Relay(db_url, {"default": destination}, owner="crashed", **options) as crashed,
        Relay(db_url, {"default": destination}, owner="survivor", **options) as survivor,
    ):
        examples = iter(range(1_000_000))

        @settings(
            max_examples=fuzz.examples(80),
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(data=st.data())
        def one_turn(data: st.DataObject) -> None:
            n = next(examples)
            with engine.begin() as conn:
                conn.execute(sa.delete(messages))
            # One message whose relay died mid-send (resolved by the lookup) and two to send.
            publish_many(engine, [f"gone-{n}"], clock=clock)
            crashed.leases.claim()
            clock.advance(LEASE + 1)
            fresh = [f"new-{n}-a", f"new-{n}-b"]
            publish_many(engine, fresh, clock=clock)
            peer.answers = {
                "POST": _answer(data, fresh),
                "GET": _answer(data, [f"gone-{n}", *fresh]),
            }
            verdicts = dict(survivor.dispatch_once())
            states = {reply_id: row["state"] for reply_id, row in rows(engine).items()}
            assert set(verdicts) == set(states), (verdicts, states)
            assert "sending" not in states.values(), states
            # The message with no attempts left ends now, one way or the other.
            assert states[f"gone-{n}"] in ("sent", "dead"), states

        one_turn()


@pytest.mark.parametrize(
    "value",
    ["\u00b2", "\u0663", "Mon, 32 Foo 99999 99:99:99 +9999", "Sun, 31 Dec 9999 23:59:60 +2400"],
)
def test_an_unreadable_retry_after_is_no_hint(value: str) -> None:
    assert parse_retry_after(value) is None
