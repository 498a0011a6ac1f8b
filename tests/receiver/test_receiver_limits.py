"""A real `outbox receiver` process holds bounded memory and connections against clients
without credentials: huge headers, slow or half-sent requests, idle connections and
many large unsigned bodies at once, while valid requests keep answering.

Each test runs twice: on httptools (the `fast` extra) and on h11, as a plain install
serves; the limits are the same on both."""

from __future__ import annotations

import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.plain_install import plain_install_variables
from support.receiver_helpers import SECRET, ReceiverProcess, signed, wait_until

BODY = b'{"kind":"result","task_id":"t-1","status":"done","result":{"ok":true}}'
MIB = 1_048_576
REQUEST_TIMEOUT = 2.0
HEADER_LIMIT = 16_384
KEEP_ALIVE = 1.0
LIMITS = {
    "OUTBOX_RECEIVER_HEADER_LIMIT": str(HEADER_LIMIT),
    "OUTBOX_RECEIVER_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
    "OUTBOX_RECEIVER_MAX_CONNECTIONS": "50",
    "OUTBOX_RECEIVER_MAX_BODY": str(MIB),
    "OUTBOX_RECEIVER_BODY_BUDGET": str(2 * MIB),
    "OUTBOX_RECEIVER_KEEP_ALIVE": str(KEEP_ALIVE),
}
# Generous: the machine may be loaded, but an unbounded process grows by far more.
RSS_GROWTH_BOUND = 24 * MIB
CUT_OFF = REQUEST_TIMEOUT + 8.0  # the deadline plus room for a loaded machine
STARTUP = 90.0  # seconds for the receiver to answer: a loaded machine imports slowly


def parses_with_httptools(process: ReceiverProcess) -> bool:
    """Whether httptools' C parser is loaded in the process (Linux /proc)."""
    maps = Path(f"/proc/{process.proc.pid}/maps").read_text(encoding="utf-8")
    return "/httptools/" in maps


@pytest.fixture(params=["httptools", "h11"], scope="module")
def receiver(
    request: pytest.FixtureRequest,
    sqlite_template: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ReceiverProcess]:
    """A receiver with small limits, so each can be reached quickly, on the parser named.

    On SQLite only: the limits act before any database is asked. One process per parser
    serves every test of the module, as a service serves one client after another: each
    test uses its own reply_ids and waits for its own connections to end.
    """
    tmp_path = tmp_path_factory.mktemp(f"limits-{request.param}")
    parser = request.param
    if parser == "httptools":
        pytest.importorskip("httptools")
        env = LIMITS
    else:
        env = {**plain_install_variables(), **LIMITS}
    database = tmp_path / "receiver.db"
    shutil.copyfile(sqlite_template, database)
    secrets = tmp_path / "secrets"
    secrets.write_text(SECRET + "\n", encoding="utf-8")
    process = ReceiverProcess(f"sqlite:///{database}", secrets, env)
    try:
        process.wait_ready(timeout=STARTUP)
        assert parses_with_httptools(process) == (parser == "httptools")
        yield process
    finally:
        process.stop()


def rss(process: ReceiverProcess) -> int:
    """The process's resident memory in bytes (Linux /proc)."""
    status = Path(f"/proc/{process.proc.pid}/status").read_text(encoding="ascii")
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def connect(process: ReceiverProcess) -> socket.socket:
    """A raw TCP connection to the receiver."""
    return socket.create_connection(("127.0.0.1", process.port), timeout=10)


def answer_or_close(sock: socket.socket, within: float) -> bytes:
    """What the server sends before it closes, waiting at most `within` seconds."""
    deadline = time.monotonic() + within
    received = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"connection still open after {within}s: {received[:80]!r}")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def read_answer(sock: socket.socket) -> bytes:
    """The head of one whole answer (its Content-Length body read too), connection left open."""
    sock.settimeout(CUT_OFF)
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before the answer ended: {received[:80]!r}")
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    declared = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert declared is not None, head
    while len(body) < int(declared.group(1)):
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before the body ended: {head[:80]!r}")
        body += chunk
    return head


def signed_request(reply_id: str, body: bytes = BODY) -> bytes:
    """A correctly signed POST /replies, as raw HTTP/1.1."""
    headers = signed(reply_id, body)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    start = f"POST /replies HTTP/1.1\r\nHost: r\r\n{head}Content-Length: {len(body)}\r\n\r\n"
    return start.encode() + body


def post_valid(process: ReceiverProcess, reply_id: str) -> tuple[int, float]:
    """Status and seconds taken of a correctly signed POST /replies."""
    started = time.monotonic()
    response = httpx.post(
        process.base + "/replies", content=BODY, headers=signed(reply_id, BODY), timeout=30
    )
    return response.status_code, time.monotonic() - started


def test_huge_header_is_refused_without_buffering_it(receiver: ReceiverProcess) -> None:
    before = rss(receiver)
    sock = connect(receiver)
    sock.sendall(b"POST /replies HTTP/1.1\r\nHost: r\r\nX-Big: ")
    chunk = b"a" * 65536
    refused = False
    try:
        for _ in range(64 * MIB // len(chunk)):
            sock.sendall(chunk)
    except (BrokenPipeError, ConnectionResetError):
        refused = True
    reply = b"" if refused else answer_or_close(sock, CUT_OFF)
    sock.close()
    assert refused or reply.startswith(b"HTTP/1.1 431"), reply[:80]
    assert rss(receiver) - before < RSS_GROWTH_BOUND
    assert post_valid(receiver, "reply:after-header")[0] == 200


def test_a_header_block_just_over_the_limit_gets_431(receiver: ReceiverProcess) -> None:
    sock = connect(receiver)
    sock.sendall(b"POST /replies HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * HEADER_LIMIT)
    reply = answer_or_close(sock, CUT_OFF)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:80]


def test_body_bytes_sent_with_the_headers_are_not_counted_as_headers(
    receiver: ReceiverProcess,
) -> None:
    # Head and a body larger than the header limit in one write: the reads hold both.
    body = b'{"kind":"result","task_id":"t-1","status":"done","result":{"pad":"%s"}}' % (
        b"x" * HEADER_LIMIT
    )
    sock = connect(receiver)
    sock.sendall(signed_request("reply:large-body", body))
    head = read_answer(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 200"), head[:80]


def test_slow_and_half_sent_requests_are_cut_off(receiver: ReceiverProcess) -> None:
    half_sent = [connect(receiver) for _ in range(30)]
    for sock in half_sent:
        sock.sendall(b"POST /replies HTTP/1.1\r\nHost: r\r\n")
    slow = connect(receiver)
    started = time.monotonic()
    status, took = post_valid(receiver, "reply:meanwhile")
    assert status == 200
    assert took < REQUEST_TIMEOUT  # not queued behind the slow ones
    # A client that keeps sending, one header byte at a time, is cut off all the same.
    try:
        slow.sendall(b"POST /replies HTTP/1.1\r\nHost: r\r\nX-Slow: ")
        while time.monotonic() - started < CUT_OFF:
            slow.sendall(b"a")
            time.sleep(0.2)  # being slow is what this client is for
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - started < CUT_OFF, "the slow client was never cut off"
    for sock in half_sent:
        reply = answer_or_close(sock, CUT_OFF)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:80]
        sock.close()
    slow.close()


def test_content_length_larger_than_the_body_ends_in_time(receiver: ReceiverProcess) -> None:
    headers = signed("reply:short", BODY)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock = connect(receiver)
    started = time.monotonic()
    declared = len(BODY) + 100
    request = f"POST /replies HTTP/1.1\r\nHost: r\r\n{head}Content-Length: {declared}\r\n\r\n"
    sock.sendall(request.encode() + BODY)
    reply = answer_or_close(sock, CUT_OFF)
    sock.close()
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:80]
    assert time.monotonic() - started >= REQUEST_TIMEOUT * 0.9  # not refused for nothing


def test_connections_beyond_the_cap_stay_bounded(receiver: ReceiverProcess) -> None:
    before = rss(receiver)
    idle = [connect(receiver) for _ in range(300)]
    status, took = post_valid(receiver, "reply:capped")
    assert status in (200, 503)
    assert took < REQUEST_TIMEOUT
    assert rss(receiver) - before < RSS_GROWTH_BOUND
    for sock in idle:
        answer_or_close(sock, CUT_OFF)  # connections that send nothing are closed too
        sock.close()
    wait_until(lambda: post_valid(receiver, "reply:uncapped")[0] == 200, 20, "a 200 again")


def test_an_idle_connection_stays_open_for_keep_alive_then_closes(
    receiver: ReceiverProcess,
) -> None:
    sock = connect(receiver)
    for reply_id in ("reply:kept-1", "reply:kept-2"):  # two requests, one connection
        sock.sendall(signed_request(reply_id))
        head = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 200"), head[:80]
    answered = time.monotonic()
    assert answer_or_close(sock, CUT_OFF) == b""
    sock.close()
    assert time.monotonic() - answered >= KEEP_ALIVE * 0.9  # not closed for nothing


def test_bodies_beyond_the_budget_get_503_with_retry_after(receiver: ReceiverProcess) -> None:
    before = rss(receiver)
    head = b"POST /replies HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    holders = []
    for _ in range(12):
        sock = connect(receiver)
        sock.sendall(head + f"Content-Length: {MIB - 1}\r\n\r\n".encode() + b"{" * 1024)
        holders.append(sock)
    replies = []
    for sock in holders[2:]:  # the first two fit the 2 MiB budget and hold it
        replies.append(answer_or_close(sock, CUT_OFF))
        sock.close()
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 503"), reply[:80]
        assert b"\r\nretry-after: " in reply.lower()
    assert rss(receiver) - before < RSS_GROWTH_BOUND
    for sock in holders[:2]:
        sock.close()
    # The holders' bytes went back to the budget when they left.
    wait_until(lambda: post_valid(receiver, "reply:budget")[0] == 200, 20, "a 200 again")
