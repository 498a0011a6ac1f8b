"""The relay's own NATS header encoding sends exactly what nats-py's would.

No server: both clients' publish commands are captured where they are queued
for the socket, and compared byte for byte.
"""

from __future__ import annotations

import json
import logging
import types
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.protocol.parser import Parser
from support.relay_helpers import SECRET

from relay import make_destination
from relay.policy import Dead, Retry, Sent
from relay.records import Message
from relay.transports.nats import NatsTransport
from relay.transports.nats_client import CHUNK_BYTES, queued_command, relay_client
from relay.transports.nats_wire import BadHeaderName, HeaderBlock, Publish, header_block

HEADER_SETS: list[dict[str, str]] = [
    {"Nats-Msg-Id": "r-1", "webhook-signature": "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9ND/H+pI4="},
    {" padded ": "  both ends  ", "tab": "\tin\tside\t"},
    {"crlf": "one\r\ntwo\rthree\nfour", "x": "ok"},
    {"": "an empty name is left out", "   ": "so is a blank one", "kept": "yes"},
    {"unicode": "caf\u00e9 \u2603", "empty-value": ""},
    {},
]


@pytest.mark.parametrize("headers", HEADER_SETS)
def test_the_relay_sends_the_bytes_nats_py_would(headers: dict[str, str]) -> None:
    theirs = queued_command(Client(), "subject.a", dict(headers))
    ours = queued_command(relay_client(nats)(), "subject.a", HeaderBlock(headers))
    assert theirs is not None
    assert ours == theirs
    assert header_block(headers) in ours


def test_the_installed_nats_py_takes_the_relays_encoding() -> None:
    # Fails when a nats-py upgrade changes the internals the relay's client overrides:
    # the relay would still publish the same bytes, only slower (see relay.transports.nats_client).
    assert relay_client(nats) is not Client
    assert issubclass(relay_client(nats), Client)


def test_a_parcel_queued_at_once_sends_what_publishing_each_would() -> None:
    headers = [HeaderBlock({"Nats-Msg-Id": f"r-{n}", "k": " v "}) for n in range(3)]
    big = b"x" * CHUNK_BYTES  # the second command ends the first chunk
    publishes = [
        Publish("a.1", "_INBOX.x.1", b"{}", headers[0], 1),
        Publish("a.2", "_INBOX.x.2", big, headers[1], 2),
        Publish("a.3", "_INBOX.x.3", b"[]", headers[2], 3),
    ]
    each = b"".join(queued_command_to(p.subject, p.reply, p.payload, p.headers) for p in publishes)
    client = relay_client(nats)()
    queued: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        queued.append(cmd)

    client._send_command = capture
    client._status = Client.CONNECTED
    step = client.publish_many(publishes)
    with pytest.raises(StopIteration):
        step.send(None)
    assert b"".join(queued) == each
    assert len(queued) == 2
    assert client.stats["out_msgs"] == 3
    assert client.stats["out_bytes"] == 4 + len(big)


def queued_command_to(subject: str, reply: str, payload: bytes, headers: HeaderBlock) -> bytes:
    """What nats-py itself queues to publish `payload` with `headers` (their dict)."""
    client = Client()
    queued: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        queued.append(cmd)

    client._send_command = capture
    step = client._send_publish(subject, reply, payload, len(payload), dict(headers))
    with pytest.raises(StopIteration):
        step.send(None)
    return queued[0]


def test_a_closed_connection_queues_nothing() -> None:
    client = relay_client(nats)()
    step = client.publish_many([Publish("a", "_INBOX.x.1", b"{}", HeaderBlock({}), 1)])
    with pytest.raises(nats.errors.ConnectionClosedError):
        step.send(None)


def test_an_answer_its_handler_cannot_take_is_reported_and_the_next_one_read() -> None:
    client = relay_client(nats)()
    taken: list[str] = []
    reported: list[Exception] = []

    def handler(token: str, data: bytes, headers: Any) -> None:
        if token == "1":
            raise TypeError("unreadable")
        taken.append(token)

    async def report(exc: Exception) -> None:
        reported.append(exc)

    client._error_cb = report
    client.take_answers("_INBOX.r", handler)
    step = client._ps.parse(b"MSG _INBOX.r.1 1 2\r\n{}\r\nMSG _INBOX.r.2 1 2\r\n{}\r\n")
    with pytest.raises(StopIteration):
        step.send(None)
    assert taken == ["2"]
    assert [str(exc) for exc in reported] == ["unreadable"]


def test_plain_headers_still_go_through_nats_py() -> None:
    # The JetStream API requests of the same client (stream info) pass dicts, not blocks.
    headers = {"Nats-Expected-Stream": "S", "x": " y "}
    ours = queued_command(relay_client(nats)(), "subject.a", headers)
    assert ours == queued_command(Client(), "subject.a", headers)


def test_an_empty_subject_is_refused_as_nats_py_refuses_it() -> None:
    # Sent on, "HPUB  <reply> ..." would publish the message to the relay's own inbox.
    headers = {"Nats-Msg-Id": "r-1"}
    with pytest.raises(nats.errors.BadSubjectError):
        queued_command(Client(), "", dict(headers))
    with pytest.raises(nats.errors.BadSubjectError):
        queued_command(relay_client(nats)(), "", HeaderBlock(headers))


def test_a_name_nats_would_refuse_is_refused_before_publishing() -> None:
    with pytest.raises(BadHeaderName, match="not a NATS header name"):
        header_block({"bad name": "x"})
    with pytest.raises(nats.errors.BadHeaderError):
        queued_command(Client(), "subject.a", {"bad name": "x"})


def nats_with(client: type) -> types.ModuleType:
    """A stand-in for the nats package whose Client is `client`."""
    module = types.ModuleType("nats_changed")
    module.aio = types.SimpleNamespace(  # type: ignore[attr-defined]
        client=types.SimpleNamespace(Client=client, __version__="9.9.9")
    )
    module.errors = nats.errors  # type: ignore[attr-defined]
    return module


def test_a_nats_py_of_another_shape_keeps_its_own_publish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Changed:
        async def _send_publish(self, subject: str, reply: str, payload: bytes) -> None:
            """A different shape than the one the relay overrides."""

        async def _send_command(self, cmd: bytes) -> None:
            """Present."""

        async def _flush_pending(self) -> None:
            """Present."""

    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        assert relay_client(nats_with(Changed)) is Changed
    assert "through nats-py's own client" in caplog.text


def test_a_nats_py_that_encodes_otherwise_keeps_its_own_publish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Lowering(Client):  # type: ignore[misc]
        """Same method, another rule: a release that sends names in lower case."""

        async def _send_publish(
            self,
            subject: str,
            reply: str,
            payload: bytes,
            payload_size: int,
            headers: dict[str, str] | None,
        ) -> None:
            lowered = {k.lower(): v for k, v in (headers or {}).items()}
            await super()._send_publish(subject, reply, payload, payload_size, lowered)

    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        assert relay_client(nats_with(Lowering)) is Lowering
    assert "9.9.9" in caplog.text


def test_a_nats_py_that_hands_messages_on_otherwise_keeps_its_own_subscriptions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Decoding(Client):  # type: ignore[misc]
        """A release whose parser hands subjects on as text."""

        def __init__(self) -> None:
            super().__init__()
            client = self

            class Decoded:
                def __getattr__(self, name: str) -> Any:
                    return getattr(client, name)

                async def _process_msg(
                    self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: Any
                ) -> None:
                    await client._process_msg(sid, subject.decode(), reply, data, headers)

            self._ps = Parser(Decoded())

    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        assert relay_client(nats_with(Decoding)) is Decoding
    assert "9.9.9" in caplog.text


def transport(stream: str) -> NatsTransport:
    """A transport for `stream` (nothing connects)."""
    return NatsTransport(
        make_destination(
            "nats://127.0.0.1:4222",
            kind="nats",
            stream=stream,
            subject="s.{ordering_key}",
            unsigned=True,
        )
    )


@pytest.mark.parametrize(
    ("stream", "answer", "expected"),
    [
        ("S", b'{"stream":"S", "seq":12}', Sent),
        ("S", b'{"stream":"S","seq":12}', Sent),
        ("S", b'{"stream":"S", "seq":12,"duplicate": true}', Sent),
        ("S", b'{"stream":"S", "domain":"hub", "seq":12}', Sent),
        ("S", b'{"error":{"code":400,"err_code":10060,"description":"x"},"stream":"S"}', Dead),
        ("S", b'{"error":{"code":503,"description":"x"}}', Retry),
        ("S", b'{"error":{"code":[400],"description":"x"}}', Retry),
        ("S", b'{"error":{"code":{"c":400}}}', Retry),
        ("S", b'{"stream":"S2", "seq":12}', Retry),  # another stream: not this destination's
        ("S2", b'{"stream":"S", "seq":12}', Retry),
        ("S", b'{"stream":"S"', Retry),  # cut short: read in full, and unreadable
        ('a"b', b'{"stream":"a\\"b", "seq":1}', Sent),
        ('a"b', b'{"stream":"a", "seq":1}', Retry),
        ("caf\u00e9", '{"stream":"caf\u00e9", "seq":1}'.encode(), Sent),  # Go writes UTF-8
    ],
)
def test_pub_acks_read_as_a_full_read_would(stream: str, answer: bytes, expected: type) -> None:
    assert type(transport(stream)._answer(answer, None)) is expected


@pytest.mark.parametrize("stream", ["S", 'a"b', "ORDERS_2"])
def test_a_pub_ack_of_the_stream_is_read_without_parsing_it(
    stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = b'{"stream":%s, "seq":7}' % json.dumps(stream).encode()
    reader = transport(stream)

    def refuse(text: bytes) -> Any:
        raise AssertionError("parsed in full")

    monkeypatch.setattr("relay.transports.nats_connection.json.loads", refuse)
    assert type(reader._answer(answer, None)) is Sent


def prepared(message_id: int, reply_id: str, headers: dict[str, Any]) -> Any:
    """What a signed transport makes of one message before publishing it (no server)."""
    destination = make_destination(
        "nats://127.0.0.1:4222", kind="nats", stream="S", subject="s.x", secret=SECRET
    )
    link = types.SimpleNamespace(client=types.SimpleNamespace(max_payload=1 << 20), inbox="_I")
    message = Message(message_id, reply_id, "default", b"{}", "0" * 64, headers, 1, 1)
    return NatsTransport(destination)._prepare(link, message, "1", 1_796_000_000)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reply_id", "headers", "why"),
    [
        ("r.1", {}, "cannot be published"),  # no signature can name it
        ("r-1", {"x": 7}, "cannot be published"),  # a value that is not text
        ("r-1", {"x": "\ud800"}, "cannot be published"),  # not encodable as UTF-8
        ("r-1", {" Nats-Rollup": "all"}, "reserved for NATS"),  # written stripped
        # nats-py's fetch drops or fails on a message with a Status header: its consumer
        # would never see it, nor, on a failure, anything behind it.
        ("r-1", {"Status": "500"}, "header 'Status' is reserved for NATS"),
        ("r-1", {"description ": "x"}, "header 'description ' is reserved for NATS"),
    ],
)
def test_a_row_no_publish_stores_is_dead_alone(
    reply_id: str, headers: dict[str, Any], why: str
) -> None:
    refused = prepared(1, reply_id, headers)
    assert type(refused) is Dead
    assert why in refused.error
    assert type(prepared(2, "r-2", {})) is Publish  # its parcel-mates still go out
