"""The metrics server: loopback by default, bounded in connections, and deaf to silence."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from support.receiver_helpers import wait_until

from outbox.observability.server import DEFAULT_HOST, MetricsServer


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    """A metrics server with a small connection cap and a short read timeout."""
    with MetricsServer(
        0,
        render=lambda: b"up 1\n",
        health=lambda: {"ok": True},
        ready=lambda: {"ok": True},
        max_connections=2,
        read_timeout=3.0,
    ) as running:
        yield running


def scrape(port: int) -> int | None:
    """The status of GET /metrics, or None when the server did not answer."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code
    except httpx.TransportError:
        return None


def test_it_listens_on_loopback_unless_told_otherwise(server: MetricsServer) -> None:
    assert DEFAULT_HOST == "127.0.0.1"
    assert server._server.server_address[0] == "127.0.0.1"


def test_idle_connections_are_capped_and_dropped_after_the_read_timeout(
    server: MetricsServer,
) -> None:
    with ExitStack() as held:
        for _ in range(2):  # fill every slot with a client that says nothing
            idle = held.enter_context(socket.create_connection(("127.0.0.1", server.port)))
            idle.settimeout(5)
        wait_until(lambda: scrape(server.port) is None, 5, "the cap to turn a scrape away")
        # Over the cap a connection is closed at once, not given a thread.
        extra = held.enter_context(socket.create_connection(("127.0.0.1", server.port)))
        extra.settimeout(5)
        started = time.monotonic()
        assert extra.recv(1) == b""
        assert time.monotonic() - started < 2
        # The silent clients are dropped after the read timeout, and scrapes answer again.
        wait_until(lambda: scrape(server.port) == 200, 15, "a scrape once the idle ones timed out")
