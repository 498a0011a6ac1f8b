"""The metrics server: loopback by default, bounded in connections, and deaf to silence."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from support.receiver_helpers import wait_until

from outbox.observability.server import DEFAULT_HOST, MetricsServer

WAIT = 60.0
"""Seconds to wait for what the server does next, however busy the machine."""


def metrics_server(read_timeout: float) -> MetricsServer:
    """A metrics server with a small connection cap and the given read timeout."""
    return MetricsServer(
        0,
        render=lambda: b"up 1\n",
        health=lambda: {"ok": True},
        ready=lambda: {"ok": True},
        max_connections=2,
        read_timeout=read_timeout,
    )


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    """A metrics server with a small connection cap and a short read timeout."""
    with metrics_server(read_timeout=3.0) as running:
        yield running


def scrape(port: int) -> int | None:
    """The status of GET /metrics, or None when the server did not answer."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code
    except httpx.TransportError:
        return None


def fill_every_slot(held: ExitStack, port: int) -> None:
    """Hold the server's two connection slots with clients that say nothing."""
    for _ in range(2):
        held.enter_context(socket.create_connection(("127.0.0.1", port)))
    wait_until(lambda: scrape(port) is None, WAIT, "the cap to turn a scrape away")


def test_it_listens_on_loopback_unless_told_otherwise(server: MetricsServer) -> None:
    assert DEFAULT_HOST == "127.0.0.1"
    assert server._server.server_address[0] == "127.0.0.1"


def test_a_connection_over_the_cap_is_closed_at_once_not_queued() -> None:
    # The idle clients' read timeout is far beyond this test's wait: while they hold
    # every slot, only the cap can close the extra connection within that wait.
    with metrics_server(read_timeout=10 * WAIT) as server, ExitStack() as held:
        fill_every_slot(held, server.port)
        extra = held.enter_context(socket.create_connection(("127.0.0.1", server.port)))
        extra.settimeout(WAIT)
        assert extra.recv(1) == b""


def test_idle_connections_are_dropped_after_the_read_timeout(server: MetricsServer) -> None:
    with ExitStack() as held:
        fill_every_slot(held, server.port)
        # The silent clients are dropped after the read timeout, and scrapes answer again.
        wait_until(
            lambda: scrape(server.port) == 200, WAIT, "a scrape once the idle ones timed out"
        )
