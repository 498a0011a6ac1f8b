"""A local OTLP/HTTP endpoint for traced benchmark runs: takes span exports and counts them.

The traced processes export to it as they would to a collector (POST /v1/traces,
protobuf); it answers 200 with an empty ExportTraceServiceResponse, which is a full
success, and counts the requests and their bytes without decoding them: a run's cost
is the exporting side's, and a run that exported nothing is caught by its counts.
It serves on a thread of the benchmark's own process, on a loopback port of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TRACES_PATH = "/v1/traces"


@dataclass
class Exports:
    """What the sink has taken so far: export requests and their bodies' bytes."""

    requests: int = 0
    body_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, size: int) -> None:
        """Count one export request of `size` bytes."""
        with self._lock:
            self.requests += 1
            self.body_bytes += size

    def snapshot(self) -> tuple[int, int]:
        """(requests, bytes) so far, read together."""
        with self._lock:
            return self.requests, self.body_bytes


@dataclass(frozen=True)
class Sink:
    """A running sink: the endpoint to export to and what it has taken."""

    endpoint: str
    """The base URL, for OTEL_EXPORTER_OTLP_ENDPOINT (the exporter adds /v1/traces)."""
    exports: Exports


def _handler(exports: Exports) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive, as the exporter's HTTP session expects of a collector.
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            """Take an export: 200 and counted on /v1/traces, 404 elsewhere."""
            length = self.headers.get("Content-Length")
            if length is None:
                # A chunked body would not be read: refused, so the exporter reports it.
                self._answer(411)
                return
            body = self.rfile.read(int(length))
            if self.path != TRACES_PATH:
                self._answer(404)
                return
            exports.add(len(body))
            self._answer(200)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: a drain's exports would fill the benchmark's progress output."""

    return Handler


@contextmanager
def otlp_sink() -> Iterator[Sink]:
    """A sink serving on a free loopback port while inside; stopped after."""
    exports = Exports()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(exports))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="otlp-sink", daemon=True)
    thread.start()
    try:
        yield Sink(f"http://127.0.0.1:{server.server_address[1]}", exports)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
