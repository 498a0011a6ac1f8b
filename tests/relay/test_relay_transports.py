"""The destination transport interface: a new kind of destination is one Transport class.

A transport registered under a new kind receives the relay's messages grouped
into its own parcels, and its outcomes are settled like HTTP's; an unknown
kind is refused when the relay starts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import pytest
import sqlalchemy as sa
from support.raw_peer import RawPeer
from support.relay_helpers import SECRET, publish_many, rows

from outbox.errors import ConfigError
from outbox.testing import ManualClock
from relay import Destination, Relay, make_destination, transports
from relay.destination import KindOptions
from relay.policy import Outcome, Retry, Sent
from relay.receipts import ask_receipt
from relay.records import Message
from relay.transports.base import Parcel, Transport
from relay.transports.http import health_url


@dataclass(frozen=True)
class MemoryOptions(KindOptions):
    """A kind with no keys of its own."""

    KIND: ClassVar[str] = "memory"


class InMemoryTransport(Transport):
    """Delivers into a list, two messages per parcel; refuses messages marked 'refuse'."""

    delivered: ClassVar[list[str]] = []
    parcel_sizes: ClassVar[list[int]] = []

    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """Pairs of messages."""
        return [Parcel(messages[i : i + 2]) for i in range(0, len(messages), 2)]

    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """Append each message's reply_id; 'refuse' ones are retried later."""
        self.parcel_sizes.append(len(parcel.messages))
        outcomes: dict[int, Outcome] = {}
        for message in parcel.messages:
            if "refuse" in message.reply_id:
                outcomes[message.id] = Retry(None, "refused by the test transport")
            else:
                self.delivered.append(message.reply_id)
                outcomes[message.id] = Sent(None)
        return outcomes

    async def holds(self, message: Message) -> bool | None:
        """Holds what it delivered."""
        return message.reply_id in self.delivered

    async def retention(self) -> float | None:
        """Says nothing about retention."""
        return None

    async def close(self) -> None:
        """Nothing to release."""


def test_a_transport_of_a_new_kind_delivers_and_its_outcomes_settle(
    db_url: str, engine: sa.Engine, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        transports.KINDS, "memory", transports.Kind(InMemoryTransport, MemoryOptions)
    )
    monkeypatch.setattr(InMemoryTransport, "delivered", [])
    monkeypatch.setattr(InMemoryTransport, "parcel_sizes", [])
    publish_many(engine, ["m-1", "m-2", "m-3", "refuse-4"], clock=clock)
    memory = make_destination("http://unused.invalid/", kind="memory", unsigned=True)
    with Relay(db_url, {"default": memory}, clock=clock, batch=10) as relay:
        verdicts = dict(relay.dispatch_once())
    assert verdicts == {"m-1": "sent", "m-2": "sent", "m-3": "sent", "refuse-4": "retry"}
    assert InMemoryTransport.delivered == ["m-1", "m-2", "m-3"]
    assert sorted(InMemoryTransport.parcel_sizes) == [2, 2]
    stored = rows(engine)
    assert [stored[r]["state"] for r in ("m-1", "m-2", "m-3", "refuse-4")] == [
        "sent",
        "sent",
        "sent",
        "pending",
    ]


def test_an_unknown_kind_is_refused(
    db_url: str, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"kind 'kafka' is not one of \[.*'http'.*\]"):
        make_destination("http://unused.invalid/", kind="kafka", unsigned=True)
    # Options of a kind the registry does not hold: refused when the relay starts.
    monkeypatch.setattr(MemoryOptions, "KIND", "kafka")
    kafka = Destination("http://unused.invalid/", MemoryOptions(), unsigned=True)
    with pytest.raises(ConfigError, match=r"kind 'kafka' is not one of \[.*'http'.*\]"):
        Relay(db_url, {"default": kafka})


@pytest.mark.parametrize(
    ("url", "health"),
    [
        ("http://h:8000", "http://h:8000/healthz"),
        ("http://h:8000/", "http://h:8000/healthz"),
        ("http://h/replies", "http://h/healthz"),
        ("http://h/api/replies/?token=x", "http://h/api/healthz"),
    ],
)
def test_the_retention_is_read_next_to_the_destination_url(url: str, health: str) -> None:
    assert health_url(url) == health


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b'{"content_hash":"%s"}', "held"),
        (b'{"content_hash":"0000"}', "other body"),
        (b'{"reply_id":"r-1"}', None),
        (b'{"content_hash":null}', None),
        (b"[]", None),
    ],
)
def test_a_lookup_answer_without_a_hash_says_nothing(
    peer: RawPeer, answer: bytes, said: str | None
) -> None:
    digest = hashlib.sha256(b"{}").hexdigest()
    body = answer.replace(b"%s", digest.encode())
    peer.answers = {"GET": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)}
    destination = make_destination(peer.url, secret=SECRET, timeout=2)
    assert ask_receipt(destination, "r-1", digest) == said
