"""A JetStream message's headers built from the template are those of the general path.

No server: NatsHeaders.build and NatsHeaders.general are compared, headers and
block, over hostile and ordinary messages; whatever one refuses the other does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.relay_helpers import SECRET

from relay import make_destination
from relay.records import Message
from relay.transports.nats_headers import NatsHeaders
from relay.transports.nats_wire import HeaderBlock, header_block

BODY = b'{"n":1}'
HASH = hashlib.sha256(BODY).hexdigest()
SECONDS = 1_796_000_000


def builder(signed: bool, stream: str = "ORDERS") -> NatsHeaders:
    """The headers of a destination publishing to `stream`, signed or not."""
    options: dict[str, Any] = {"secret": SECRET} if signed else {"unsigned": True}
    return NatsHeaders(
        make_destination(
            "nats://127.0.0.1:4222", kind="nats", stream=stream, subject="s", **options
        ),
        stream,
    )


def message(
    reply_id: str = "r-1",
    headers: Mapping[str, str] | None = None,
    content_hash: str = HASH,
    ordering_key: str | None = None,
) -> Message:
    """A claimed message with these fields."""
    return Message(7, reply_id, "default", BODY, content_hash, headers or {}, 1, 1, ordering_key)


def outcome(build: Any, of: Message) -> tuple[dict[str, str], bytes] | tuple[str, str]:
    """The headers and block `build` gives, or the class and message of what it raised."""
    try:
        block: HeaderBlock = build(of, SECONDS)
    except Exception as exc:  # compared by class and message between the two paths
        return type(exc).__name__, str(exc)
    assert block.block == header_block(block)  # each path: its bytes say its headers
    return dict(block), block.block


def assert_same(headers: NatsHeaders, of: Message) -> None:
    """Both paths give the same headers and bytes, or refuse alike."""
    assert outcome(headers.build, of) == outcome(headers.general, of)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize(
    "of",
    [
        message(),
        message(headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f0-01"}),
        message(headers={"webhook-id": "mine", "x": "1"}),  # the relay's value wins, in place
        message(headers={"content-type": "text/plain"}),
        message(headers={" webhook-id ": "padded name"}),
        message(headers={"Content-Type": "other case"}),
        message(headers={"Outbox-Ordering-Key": "not its own", "x": "1"}),
        message(headers={"outbox-ordering-key": "not its own"}, ordering_key="k"),
        message(headers={"bad name": "x"}),
        message(headers={"": "empty name", "crlf": "a\r\nb", "pad": "  v  "}),
        message(reply_id="r 1"),
        message(reply_id=" r-1"),
        message(reply_id="r\r\n-1"),
        message(reply_id="r.1"),
        message(reply_id="caf\u00e9"),
        message(content_hash=""),
        message(content_hash=" ab"),
        message(content_hash="a\nb"),
        message(ordering_key="customer.7"),
        message(ordering_key=" padded "),
        message(ordering_key="k", headers={"outbox-ordering-key": "mine"}),
    ],
)
def test_both_paths_give_the_same_headers_and_bytes(signed: bool, of: Message) -> None:
    assert_same(builder(signed), of)


@pytest.mark.parametrize("stream", ["S", 'a"b', "caf\u00e9"])
def test_the_stream_is_written_as_the_general_path_writes_it(stream: str) -> None:
    assert_same(builder(True, stream), message(headers={"k": "v"}))


def test_an_ordinary_message_is_built_from_the_template(monkeypatch: pytest.MonkeyPatch) -> None:
    headers = builder(True)

    def general(of: Message, seconds: int) -> HeaderBlock:
        raise AssertionError("built through the general path")

    monkeypatch.setattr(headers, "general", general)
    built = headers.build(message(headers={"traceparent": "t"}), SECONDS)
    assert list(built)[:3] == ["Nats-Msg-Id", "Nats-Expected-Stream", "traceparent"]


values = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    signed=st.booleans(),
    reply_id=st.one_of(st.from_regex(r"[a-z0-9:\-]{1,20}", fullmatch=True), values),
    content_hash=st.one_of(st.just(HASH), values),
    own=st.dictionaries(
        st.one_of(
            st.sampled_from(["traceparent", "webhook-id", "content-type", "x-a", " x-a"]), values
        ),
        values,
        max_size=4,
    ),
)
def test_any_message_gets_the_same_headers_either_way(
    signed: bool, reply_id: str, content_hash: str, own: dict[str, str]
) -> None:
    assert_same(builder(signed), message(reply_id, own, content_hash))


def test_a_keyed_message_carries_its_ordering_key() -> None:
    block = builder(True).build(message(ordering_key="customer.7"), SECONDS)
    assert block["outbox-ordering-key"] == "customer.7"
    assert b"\r\noutbox-ordering-key: customer.7\r\n" in block.block
    assert "outbox-ordering-key" not in builder(True).build(message(), SECONDS)
    # One stored among a message's own headers (before publish() refused it) is dropped.
    forged = builder(True).build(message(headers={"Outbox-Ordering-Key": "k"}), SECONDS)
    assert "outbox-ordering-key" not in {name.lower() for name in forged}
