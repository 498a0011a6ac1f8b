"""A raw TCP peer for the relay: answers each request with exactly the bytes a test sets."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RawPeer(socketserver.ThreadingTCPServer):
    """Answers every request with the bytes set for its method, then closes."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answers: dict[str, bytes] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/replies"


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.connection.settimeout(5)
        try:
            request_line = self.rfile.readline(65536)
            length = 0
            while True:
                line = self.rfile.readline(65536)
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            self.rfile.read(length)
            method = request_line.split(b" ", 1)[0].decode()
            assert isinstance(self.server, RawPeer)
            self.wfile.write(self.server.answers.get(method, b""))
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@contextmanager
def raw_peer() -> Iterator[RawPeer]:
    """A RawPeer serving on a thread until the block ends."""
    server = RawPeer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
