"""Relay observability: Prometheus counters, a latency histogram and scrape-time gauges.

Counters and the latency histogram are updated by the loop; the per-destination
gauges are read from the database at scrape time through a Probe, so they are
true even when the relay is stuck, and a database that does not answer leaves
them out (outbox_relay_database_up 0) instead of holding up the scrape.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from outbox.observability.probe import Probe
from relay.figures import Figures

DATABASE_OPERATIONS = ("claim", "settle")


class _DatabaseCollector(Collector):
    def __init__(self, read: Callable[[], Figures]) -> None:
        self.figures = Probe(read)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = self.figures()
        yield GaugeMetricFamily(
            "outbox_relay_database_up",
            "1 when the database answered this scrape's reads in time, else 0 (and the "
            "database gauges are left out).",
            value=0 if figures is None else 1,
        )
        if figures is None:
            return
        wide = "database-wide: every relay reports the same figure; aggregate with max"
        backlog = GaugeMetricFamily(
            "outbox_relay_backlog",
            f"Messages pending or being sent, per destination ({wide}).",
            labels=["destination"],
        )
        oldest = GaugeMetricFamily(
            "outbox_relay_oldest_pending_age_seconds",
            f"Age of the oldest message pending or sending, per destination (0 when none; {wide}).",
            labels=["destination"],
        )
        dead = GaugeMetricFamily(
            "outbox_relay_dead",
            f"Dead messages waiting for a decision, per destination ({wide}).",
            labels=["destination"],
        )
        for name, figure in sorted(figures.destinations.items()):
            backlog.add_metric([name], figure.backlog)
            oldest.add_metric([name], figure.oldest_age or 0.0)
            dead.add_metric([name], figure.dead)
        yield from (backlog, oldest, dead)
        yield GaugeMetricFamily(
            "outbox_relay_unrouted",
            f"Pending messages whose destination no running relay delivers ({wide}).",
            value=figures.unrouted,
        )
        yield GaugeMetricFamily(
            "outbox_relay_unrouted_oldest_age_seconds",
            "Age of the oldest unrouted message (0 when none).",
            value=figures.unrouted_oldest_age or 0.0,
        )


class RelayMetrics:
    """The relay's counters, histogram and scrape-time gauges in a registry of its own."""

    def __init__(self, figures: Callable[[], Figures], destinations: Iterable[str] = ()) -> None:
        """Create the metrics; `figures` reads the database gauges at scrape time. Each of
        `destinations` starts at 0 in the counters, so rates and alerts see it at once."""
        self.registry = CollectorRegistry()
        self.outcomes = Counter(
            "outbox_relay_outcomes",
            "Settled messages by destination, outcome (sent, retry, dead) and HTTP status.",
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
        self.claims = Counter(
            "outbox_relay_claimed",
            "Messages leased by this relay's claims, to deliver or (attempts spent) to resolve.",
            ["destination"],
            registry=self.registry,
        )
        self.lease_losses = Counter(
            "outbox_relay_lease_losses",
            "Outcomes not recorded because another relay had taken the message over "
            "(its lease expired and the fence moved on).",
            ["destination"],
            registry=self.registry,
        )
        self.database_errors = Counter(
            "outbox_relay_database_errors",
            "Claims and settles that failed after their retries (operation: claim or settle).",
            ["operation"],
            registry=self.registry,
        )
        for name in destinations:
            self.claims.labels(name)
            self.lease_losses.labels(name)
        for operation in DATABASE_OPERATIONS:
            self.database_errors.labels(operation)
        self.registry.register(_DatabaseCollector(figures))
        self.last_turn = time.monotonic()

    def record(self, destination: str, outcome: str, status: int | None, count: int = 1) -> None:
        """Count `count` settled outcomes of one kind."""
        self.outcomes.labels(destination, outcome, str(status or "none")).inc(count)

    def claimed(self, destinations: Iterable[str]) -> None:
        """Count claimed messages, given each one's destination."""
        for name, count in Tally(destinations).items():
            self.claims.labels(name).inc(count)

    def lease_lost(self, destination: str, count: int = 1) -> None:
        """Count outcomes refused because the lease had moved to another relay."""
        self.lease_losses.labels(destination).inc(count)

    def database_error(self, operation: str) -> None:
        """Count a claim or settle that failed after its retries."""
        self.database_errors.labels(operation).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
