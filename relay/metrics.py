"""Relay observability: Prometheus counters, a latency histogram and scrape-time gauges.

Counters and the latency histogram are updated by the loop; the backlog and
the age of the oldest undelivered message are read from the database at
scrape time, so they are true even when the relay is stuck.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from outbox.observability.probe import Probe

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
