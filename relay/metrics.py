"""Relay observability: Prometheus metrics and a health endpoint on one small HTTP server.

Counters and the latency histogram are updated by the loop; the backlog and
the age of the oldest undelivered message are read from the database at
scrape time, so they are true even when the relay is stuck.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from relay.probe import Probe

log = logging.getLogger("outbox.relay")
Backlog = Callable[[], tuple[int, float | None]]


class _BacklogCollector(Collector):
    def __init__(self, read: Backlog, unrouted: Backlog) -> None:
        self.figures = Probe(lambda: (read(), unrouted()))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = self.figures()
        yield GaugeMetricFamily(
            "outbox_relay_database_up",
            "1 when the database answered this scrape's reads in time, else 0 (and the "
            "backlog gauges are left out).",
            value=0 if figures is None else 1,
        )
        if figures is None:
            return
        (count, oldest_age), (unrouted, unrouted_age) = figures
        yield GaugeMetricFamily(
            "outbox_relay_unrouted",
            "Pending messages whose destination no running relay delivers (database-wide: "
            "every relay reports the same figure; aggregate with max, not sum).",
            value=unrouted,
        )
        yield GaugeMetricFamily(
            "outbox_relay_unrouted_oldest_age_seconds",
            "Age of the oldest unrouted message (0 when none).",
            value=unrouted_age or 0.0,
        )
        yield GaugeMetricFamily(
            "outbox_relay_backlog", "Messages pending or being sent.", value=count
        )
        yield GaugeMetricFamily(
            "outbox_relay_oldest_pending_age_seconds",
            "Age of the oldest message not yet sent or dead (0 when none).",
            value=oldest_age or 0.0,
        )


class RelayMetrics:
    """The relay's counters, histogram and scrape-time gauges in a registry of its own."""

    def __init__(self, backlog: Backlog, unrouted: Backlog) -> None:
        """Create the metrics; `backlog` and `unrouted` read (count, oldest age) from the
        database at scrape time."""
        self.registry = CollectorRegistry()
        self.outcomes = Counter(
            "outbox_relay_outcomes",
            "Delivery outcomes by destination, outcome (sent, retry, dead) and HTTP status.",
            ["destination", "outcome", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "outbox_relay_delivery_seconds",
            "Duration of one delivery request (a single message or a batch).",
            ["destination", "mode"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.registry.register(_BacklogCollector(backlog, unrouted))
        self.last_turn = time.monotonic()

    def record(self, destination: str, outcome: str, status: int | None, count: int = 1) -> None:
        """Count `count` settled outcomes of one kind."""
        self.outcomes.labels(destination, outcome, str(status or "none")).inc(count)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class _LoggingServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Through logging (JSON lines with --log-format json), not a raw traceback on stderr.
        log.exception("metrics server: request from %s failed", client_address[0])


class MetricsServer:
    """GET /metrics and GET /healthz on a background thread."""

    def __init__(
        self,
        metrics: RelayMetrics,
        port: int,
        health: Callable[[], dict[str, Any]],
        ready: Callable[[], dict[str, Any]],
    ) -> None:
        """Bind 0.0.0.0:`port` (0 picks a free port); /healthz is liveness, /readyz readiness."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, kind, status = metrics.render(), "text/plain; version=0.0.4", 200
                elif self.path in ("/healthz", "/readyz"):
                    state = health() if self.path == "/healthz" else ready()
                    status = 200 if state.get("ok") else 503
                    body, kind = json.dumps(state).encode(), "application/json"
                else:
                    body, kind, status = b"not found\n", "text/plain", 404
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes every few seconds would drown the relay's own logs

        self._server = _LoggingServer(("0.0.0.0", port), Handler)  # noqa: S104
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=owner._server.serve_forever, daemon=True)

    def start(self) -> MetricsServer:
        """Serve in the background."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
