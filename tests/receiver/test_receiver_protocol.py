"""The guarded protocols, on httptools and on h11: the request deadline covers receiving a
request, never the app's answer, on a fresh connection and on a kept-alive one."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from support.receiver_helpers import free_port, wait_until

from receiver.protocol import guarded
from receiver.protocol_h11 import GuardedH11
from receiver.request_guard import RequestGuard

REQUEST_TIMEOUT = 0.5
SLOW_ANSWER = 3 * REQUEST_TIMEOUT
CUT_OFF = REQUEST_TIMEOUT + 10.0  # the deadline plus room for a loaded machine
REQUEST = b"POST /work HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}"


async def slow_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the request whole, then takes SLOW_ANSWER seconds to answer 200."""
    assert scope["type"] == "http"
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await asyncio.sleep(SLOW_ANSWER)  # the work the answer waits for
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def _protocols() -> list[object]:
    httptools = pytest.param("httptools", id="httptools")
    try:
        import httptools as _  # noqa: F401
    except ImportError:
        httptools = pytest.param("httptools", marks=pytest.mark.skip("no httptools"))
    return [httptools, pytest.param("h11", id="h11")]


def _protocol(name: str) -> type[RequestGuard]:
    if name == "h11":
        return GuardedH11
    from receiver.protocol_httptools import GuardedHttpTools

    return GuardedHttpTools


@pytest.fixture(params=_protocols())
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    """A uvicorn server in a thread on the guarded protocol named, serving slow_app."""
    chosen = free_port()
    config = uvicorn.Config(
        slow_app,
        host="127.0.0.1",
        port=chosen,
        log_level="error",
        lifespan="off",
        http=guarded(_protocol(request.param), 16_384, REQUEST_TIMEOUT),
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "the server to start")
        yield chosen
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def answer(sock: socket.socket) -> bytes:
    """One whole answer (its body is 2 bytes) on a connection left open."""
    sock.settimeout(CUT_OFF)
    received = b""
    while not (b"\r\n\r\n" in received and received.endswith(b"ok")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def test_a_slow_answer_is_not_cut_off_by_the_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=CUT_OFF) as sock:
        for _ in range(2):  # the first request, then one on the kept-alive connection
            started = time.monotonic()
            sock.sendall(REQUEST)
            reply = answer(sock)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:80]
            assert time.monotonic() - started >= SLOW_ANSWER * 0.9  # answered past the deadline


@pytest.mark.parametrize("sent", [10, len(REQUEST) - 1], ids=["part-of-the-head", "all-but-one"])
def test_a_request_not_received_in_time_gets_408(port: int, sent: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=CUT_OFF) as sock:
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(REQUEST[:sent])  # the next request on the connection, unfinished
        assert answer(sock).startswith(b"HTTP/1.1 408")
