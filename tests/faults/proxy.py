"""A fault-injecting TCP proxy for HTTP/1.1, between the relay and a receiver.

It runs its own asyncio loop on a background thread, listens on a free
loopback port and forwards to an upstream host:port. What it does to each
request is switched at run time, from any thread (`set_mode`):

- ``pass``: forward both ways;
- ``lost_ack``: forward the whole request, read the upstream's whole answer,
  then close the client's connection without sending any of it;
- ``reset``: forward the head and part of the body, then reset the client's
  connection (SO_LINGER 0, then close: an RST) and drop the upstream one;
- ``trickle``: forward the request, then send the answer back one byte per
  `trickle_interval` seconds;
- ``hang``: read the request and whatever follows, never answer, never close.

The mode is read when each request starts, not when its connection is
accepted: the relay keeps connections alive, and a pooled connection must
not keep the mode it was opened under. Every mode but ``pass`` ends its
connection, so a fault costs one connection per request.

Per client connection it records when it was accepted and when it closed
(and by whom), with every request seen on it, so a test can measure how long
each attempt lasted and what was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, get_args

Mode = Literal["pass", "lost_ack", "reset", "trickle", "hang"]
MODES: tuple[Mode, ...] = get_args(Mode)
HEAD_END = b"\r\n\r\n"


@dataclass
class Exchange:
    """One request seen by the proxy, and what became of it."""

    mode: Mode
    head: bytes
    body: bytes = b""
    response: bytes = b""
    """The upstream's whole answer as the proxy read it (empty when it never asked)."""

    @property
    def method(self) -> str:
        """The request method."""
        return self.head.split(b" ", 1)[0].decode("latin-1")

    @property
    def path(self) -> str:
        """The request target."""
        return self.head.split(b" ", 2)[1].decode("latin-1")

    def header(self, name: str) -> str | None:
        """A request header's value (case-insensitive name), None when absent."""
        return _header(self.head, name)

    @property
    def response_body(self) -> bytes:
        """The body of the upstream's answer (after its head)."""
        return self.response.partition(HEAD_END)[2]


@dataclass
class Connection:
    """One client connection: when it was accepted and closed, and its requests."""

    number: int
    """0 for the first connection accepted, then 1, 2, ..."""
    accepted: float
    """time.monotonic() at accept."""
    closed: float | None = None
    """time.monotonic() when it ended; None while it is open."""
    closed_by: Literal["client", "proxy"] | None = None
    exchanges: list[Exchange] = field(default_factory=list)

    @property
    def duration(self) -> float | None:
        """Seconds from accept to close; None while open."""
        return None if self.closed is None else self.closed - self.accepted


class FaultProxy:
    """A switchable HTTP/1.1 proxy on loopback; a context manager that starts and stops it."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        mode: Mode = "pass",
        *,
        trickle_interval: float = 1.0,
    ) -> None:
        """Configure; nothing listens until start() (or `with`)."""
        self.upstream = (upstream_host, upstream_port)
        self.trickle_interval = trickle_interval
        self._lock = threading.Lock()
        self._mode: Mode = self._checked(mode)
        self._counts: Counter[str] = Counter()
        self._connections: list[Connection] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    # --- control, from any thread ------------------------------------------------

    def __enter__(self) -> FaultProxy:
        """Start listening."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Close every connection and stop the loop."""
        self.stop()

    @property
    def url(self) -> str:
        """The proxy's base URL (no trailing slash)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> Mode:
        """The mode the next request will get."""
        with self._lock:
            return self._mode

    def set_mode(self, mode: Mode) -> None:
        """Switch what happens to requests from now on (requests under way keep theirs)."""
        checked = self._checked(mode)
        with self._lock:
            self._mode = checked

    def count(self, mode: Mode) -> int:
        """Requests handled in `mode` (for every mode but pass, also its connections)."""
        with self._lock:
            return self._counts[mode]

    def connections(self) -> list[Connection]:
        """A snapshot of every client connection so far, in accept order."""
        with self._lock:
            return copy.deepcopy(self._connections)

    def exchanges(self, mode: Mode | None = None) -> list[Exchange]:
        """A snapshot of every request so far (only those in `mode` when given)."""
        return [
            exchange
            for connection in self.connections()
            for exchange in connection.exchanges
            if mode is None or exchange.mode == mode
        ]

    def start(self) -> None:
        """Start the loop thread and listen on a free loopback port."""
        if self._loop is not None:
            raise RuntimeError("proxy already started")
        # A plain asyncio loop of its own: nothing here may share the relay's loop.
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), loop).result(timeout=10)

    def stop(self) -> None:
        """Close every connection, stop the loop and join its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    @staticmethod
    def _checked(mode: str) -> Mode:
        """`mode` if it is one of MODES, else ValueError."""
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r}; expected one of {MODES}")
        return mode

    # --- on the proxy's loop ---------------------------------------------------------

    async def _listen(self) -> None:
        """Listen on a free loopback port and remember it."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        """Stop listening, drop every connection, and wait for their handlers to end."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # One more turn of the loop, so the transports closed above finish closing.
        await asyncio.sleep(0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client connection, request by request, each in the mode of its start."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        with self._lock:
            record = Connection(len(self._connections), time.monotonic())
            self._connections.append(record)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        closed_by: Literal["client", "proxy"] = "proxy"
        try:
            while True:
                try:
                    head = await reader.readuntil(HEAD_END)
                except (asyncio.IncompleteReadError, ConnectionError):
                    closed_by = "client"
                    return
                with self._lock:
                    mode = self._mode
                    self._counts[mode] += 1
                    exchange = Exchange(mode, head)
                    record.exchanges.append(exchange)
                length = int(_header(head, "content-length") or 0)
                if mode == "hang":
                    await _until_eof(reader)
                    closed_by = "client"
                    return
                if upstream is None:
                    upstream = await asyncio.open_connection(*self.upstream)
                    self._writers.add(upstream[1])
                if mode == "reset":
                    # Half the body: the upstream must see a request cut off mid-body.
                    part = await reader.readexactly(length // 2)
                    with self._lock:
                        exchange.body = part
                    upstream[1].write(head + part)
                    await upstream[1].drain()
                    _reset(writer)
                    return
                body = await reader.readexactly(length)
                upstream[1].write(head + body)
                await upstream[1].drain()
                response = await _read_response(upstream[0])
                with self._lock:
                    exchange.body, exchange.response = body, response
                if mode == "lost_ack":
                    return
                if mode == "trickle":
                    if not await self._trickle(reader, writer, response):
                        closed_by = "client"
                        return
                    continue
                writer.write(response)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            # A side went away mid-request: the client, when its end has closed or
            # reset; else the upstream, and the proxy drops the client.
            gone = reader.at_eof() or reader.exception() is not None
            closed_by = "client" if gone else "proxy"
        finally:
            with self._lock:
                record.closed = time.monotonic()
                record.closed_by = closed_by
            for end in (writer, None if upstream is None else upstream[1]):
                if end is not None:
                    self._writers.discard(end)
                    end.close()
            self._tasks.discard(task)

    async def _trickle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: bytes
    ) -> bool:
        """Send `response` one byte per interval; False as soon as the client closes."""
        gone = asyncio.ensure_future(_until_eof(reader))
        try:
            for offset in range(len(response)):
                writer.write(response[offset : offset + 1])
                await writer.drain()
                done, _ = await asyncio.wait({gone}, timeout=self.trickle_interval)
                if done:
                    return False
            return True
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)


def _header(head: bytes, name: str) -> str | None:
    """A header's value from a raw HTTP head (case-insensitive name), None when absent."""
    wanted = name.lower().encode("latin-1") + b":"
    for line in head.split(b"\r\n")[1:]:
        if line.lower().startswith(wanted):
            return line[len(wanted) :].strip().decode("latin-1")
    return None


async def _until_eof(reader: asyncio.StreamReader) -> None:
    """Read and drop everything until the peer closes (or resets) the connection."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    """One whole HTTP/1.1 response, head and body, as the bytes that came."""
    head = await reader.readuntil(HEAD_END)
    status = int(head.split(b" ", 2)[1])
    if 100 <= status < 200 or status in (204, 304):
        return head
    length = _header(head, "content-length")
    if length is not None:
        return head + await reader.readexactly(int(length))
    if "chunked" in (_header(head, "transfer-encoding") or "").lower():
        parts = [head]
        while True:
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while parts[-1] != b"\r\n":  # trailers, up to the blank line
                    parts.append(await reader.readuntil(b"\r\n"))
                return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    return head + await reader.read()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, not a FIN: linger on, zero seconds, then close at once."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
