"""A byte-stream TCP proxy that cuts every connection on cue: brokers' protocols, not HTTP.

tests/faults/proxy.py reads HTTP requests; a broker connection (AMQP, NATS) is
one long stream of frames, so this proxy forwards bytes both ways and knows
nothing of the protocol. `cut_every(n, times)` aborts every open connection
(both ends) each time another `n` bytes have gone from clients to the upstream,
`times` times; connections opened afterwards pass untouched until the next cut.
It runs its own asyncio loop on a background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class StreamProxy:
    """Forwards loopback TCP connections to an upstream; a context manager."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        """Configure; nothing listens until start() (or `with`)."""
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._lock = threading.Lock()
        self._forwarded = 0
        self._cut_at: int | None = None
        self._every = 0
        self._cuts_left = 0
        self._cuts = 0
        self._accepted = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    def __enter__(self) -> StreamProxy:
        """Start listening."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Close every connection and stop the loop."""
        self.stop()

    @property
    def cuts(self) -> int:
        """How many times every connection was cut."""
        with self._lock:
            return self._cuts

    @property
    def accepted(self) -> int:
        """Client connections accepted so far."""
        with self._lock:
            return self._accepted

    def cut_every(self, forwarded_bytes: int, times: int) -> None:
        """Cut every connection each time `forwarded_bytes` more went upstream, `times` times."""
        with self._lock:
            self._every = forwarded_bytes
            self._cuts_left = times
            self._cut_at = self._forwarded + forwarded_bytes if times > 0 else None

    def start(self) -> None:
        """Start the loop thread and listen on a free loopback port."""
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="stream-proxy", daemon=True)
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

    async def _listen(self) -> None:
        # The port of a first start (any free one) is kept: a restart listens there again.
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._abort_all()
        me = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self._accepted += 1
        serving = asyncio.current_task()
        assert serving is not None, "start_server serves each connection in a task"
        # Known at once: a stop that comes while the upstream connects cancels this task and
        # aborts this connection too, instead of leaving its transports to the collector
        # (whose ResourceWarning then fails whichever test runs next).
        self._tasks.add(serving)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return
            self._writers.add(up_writer)
            pumps = [
                asyncio.ensure_future(self._pump(reader, up_writer, upstream=True)),
                asyncio.ensure_future(self._pump(up_reader, writer, upstream=False)),
            ]
            self._tasks.update(pumps)
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                self._tasks.difference_update(pumps)
        finally:
            self._tasks.discard(serving)
            for end in (writer, up_writer):
                if end is not None:
                    self._writers.discard(end)
                    end.transport.abort()

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await source.read(65536):
                sink.write(chunk)
                await sink.drain()
                if upstream and self._count(len(chunk)):
                    self._abort_all()
                    return

    def _count(self, size: int) -> bool:
        """Count bytes sent upstream; True when that reached the next cut."""
        with self._lock:
            self._forwarded += size
            if self._cut_at is None or self._forwarded < self._cut_at:
                return False
            self._cuts += 1
            self._cuts_left -= 1
            self._cut_at = self._forwarded + self._every if self._cuts_left > 0 else None
            return True
