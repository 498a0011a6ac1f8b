"""GET /metrics, /healthz and /readyz on a background thread, for processes without a web app.

The relay and the worker serve their figures here; the receiver, a web app
already, serves the same paths on its own port. A scrape or a health check
must answer while the process is busy or its database is down, so every
answer is built from in-memory figures or a Probe with a deadline.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger("outbox.observability")
METRICS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The Prometheus text format generate_latest() writes."""
State = Callable[[], dict[str, Any]]


def status_of(state: dict[str, Any]) -> int:
    """The HTTP status of a health or readiness answer: 200 when it says ok, else 503."""
    return 200 if state.get("ok") else 503


DEFAULT_HOST = "127.0.0.1"
"""Loopback unless told otherwise: figures and health are for the host's own scrapers."""
MAX_CONNECTIONS = 16
READ_TIMEOUT = 5.0


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `limit` at once: one more is closed unanswered."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, limit: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(limit)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # A scraper asks every few seconds; a flood of idle connections must not
            # turn into a flood of threads.
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Through logging (JSON lines with --log-format json), not a raw traceback on stderr.
        log.exception("metrics server: request from %s failed", client_address[0])


class MetricsServer:
    """GET /metrics (Prometheus text), /healthz (liveness) and /readyz on a background thread."""

    def __init__(
        self,
        port: int,
        *,
        render: Callable[[], bytes],
        health: State,
        ready: State,
        host: str = DEFAULT_HOST,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        """Bind `host`:`port` (0 picks a free port); `render` writes the metrics. A
        connection that sends no whole request within `read_timeout` is closed."""

        class Handler(BaseHTTPRequestHandler):
            timeout = read_timeout  # a silent or trickling client is dropped, not waited for

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, kind, status = render(), METRICS_CONTENT_TYPE, 200
                elif self.path in ("/healthz", "/readyz"):
                    state = health() if self.path == "/healthz" else ready()
                    body, kind = json.dumps(state).encode(), "application/json"
                    status = status_of(state)
                else:
                    body, kind, status = b"not found\n", "text/plain", 404
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes every few seconds would drown the process's own logs

        self._server = _BoundedServer((host, port), Handler, max_connections)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="outbox-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        """Serve in the background."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
