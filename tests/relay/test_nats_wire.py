"""The relay's own NATS header encoding sends exactly what nats-py's would.

No server: both clients' publish commands are captured where they are queued
for the socket, and compared byte for byte.
"""

from __future__ import annotations

import asyncio
import logging
import types
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from relay import Destination
from relay.nats_transport import NatsTransport
from relay.nats_wire import BadHeaderName, HeaderBlock, header_block, relay_client
from relay.policy import Dead, Retry, Sent

HEADER_SETS: list[dict[str, str]] = [
    {"Nats-Msg-Id": "r-1", "webhook-signature": "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9ND/H+pI4="},
    {" padded ": "  both ends  ", "tab": "\tin\tside\t"},
    {"crlf": "one\r\ntwo\rthree\nfour", "x": "ok"},
    {"": "an empty name is left out", "   ": "so is a blank one", "kept": "yes"},
    {"unicode": "caf\u00e9 \u2603", "empty-value": ""},
    {},
]


async def sent_command(client: Client, headers: Any) -> bytes:
    """The command `client` queues for one publish with `headers` (no connection)."""
    queued: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        queued.append(cmd)

    client._send_command = capture  # type: ignore[method-assign]
    payload = b'{"body":1}'
    # The method the relay's client overrides; publish() before it needs a connection.
    await client._send_publish("subject.a", "_INBOX.x.7", payload, len(payload), headers)
    assert len(queued) == 1
    return queued[0]


@pytest.mark.parametrize("headers", HEADER_SETS)
def test_the_relay_sends_the_bytes_nats_py_would(headers: dict[str, str]) -> None:
    async def both() -> tuple[bytes, bytes]:
        theirs = await sent_command(Client(), dict(headers))
        ours = await sent_command(relay_client(nats)(), HeaderBlock(headers))
        return theirs, ours

    theirs, ours = asyncio.run(both())
    assert ours == theirs
    assert header_block(headers) in ours


def test_the_installed_nats_py_takes_the_relays_encoding() -> None:
    # Fails when a nats-py upgrade changes the internals the relay's client overrides:
    # the relay would still publish the same bytes, only slower (see relay.nats_wire).
    assert relay_client(nats) is not Client
    assert issubclass(relay_client(nats), Client)


def test_plain_headers_still_go_through_nats_py(caplog: pytest.LogCaptureFixture) -> None:
    # The JetStream API requests of the same client (stream info) pass dicts, not blocks.
    async def both() -> tuple[bytes, bytes]:
        headers = {"Nats-Expected-Stream": "S", "x": " y "}
        return await sent_command(Client(), headers), await sent_command(
            relay_client(nats)(), headers
        )

    theirs, ours = asyncio.run(both())
    assert ours == theirs


def test_a_name_nats_would_refuse_is_refused_before_publishing() -> None:
    with pytest.raises(BadHeaderName, match="not a NATS header name"):
        header_block({"bad name": "x"})
    with pytest.raises(nats.errors.BadHeaderError):
        asyncio.run(sent_command(Client(), {"bad name": "x"}))


def test_a_nats_py_without_those_internals_keeps_its_own_publish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Changed:
        async def _send_publish(self, subject: str, reply: str, payload: bytes) -> None:
            """A different shape than the one the relay overrides."""

        async def _send_command(self, cmd: bytes) -> None:
            """Present."""

        async def _flush_pending(self) -> None:
            """Present."""

    module = types.ModuleType("nats_changed")
    module.aio = types.SimpleNamespace(client=types.SimpleNamespace(Client=Changed))  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        assert relay_client(module) is Changed
    assert "publishing through its own header encoding" in caplog.text


def transport(stream: str) -> NatsTransport:
    """A transport for `stream` (nothing connects)."""
    return NatsTransport(
        Destination(
            "nats://127.0.0.1:4222",
            kind="nats",
            stream=stream,
            subject="s.{ordering_key}",
            unsigned=True,
        )
    )


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (b'{"stream":"S", "seq":12}', Sent),
        (b'{"stream":"S","seq":12}', Sent),
        (b'{"stream":"S", "seq":12,"duplicate": true}', Sent),
        (b'{"error":{"code":400,"err_code":10060,"description":"x"},"stream":"S","seq":0}', Dead),
        (b'{"error":{"code":503,"description":"x"}}', Retry),
        (b'{"stream":"S2", "seq":12}', Retry),  # another stream: not this destination's ack
        (b'{"stream":"S"', Retry),  # cut short: read in full, and unreadable
    ],
)
def test_pub_acks_read_quickly_as_a_full_read_would(answer: bytes, expected: type) -> None:
    assert type(transport("S")._answer(answer, None)) is expected
