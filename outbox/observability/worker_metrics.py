"""The worker's metrics: claims, outcomes by kind, lease losses and handler time.

Updated on the worker's hot path, so only counters and one histogram: no
database read there. Whether the database answers, and how many tasks are
running, are read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from outbox.observability.database import DatabaseUp

OUTCOMES = ("done", "retry", "failed", "discarded", "unrecorded")
"""Outcome labels that start at 0; a task ending another way (cancelled, expired) adds its own."""


class _Running(Collector):
    def __init__(self, running: Callable[[], int]) -> None:
        self._running = running

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "outbox_worker_running_tasks", "Tasks whose handler runs now.", value=self._running()
        )


class WorkerMetrics:
    """A Worker's counters and histogram in a registry of their own; one per Worker."""

    def __init__(self) -> None:
        """Create the metrics; a Worker given them adds its scrape-time gauges (watch())."""
        self.registry = CollectorRegistry()
        self.claims = Counter(
            "outbox_worker_claimed", "Tasks claimed by this worker.", registry=self.registry
        )
        self.outcomes = Counter(
            "outbox_worker_outcomes",
            "Handled tasks by outcome: done, retry (the attempt failed, attempts remain), "
            "failed (for good), discarded (the lease was gone, nothing written), unrecorded "
            "(the database refused the write; the lease expires), or the state the task had "
            "moved to (cancelled, expired).",
            ["outcome"],
            registry=self.registry,
        )
        self.lease_losses = Counter(
            "outbox_worker_lease_losses",
            "Leases lost while the handler ran: a renewal or the outcome's write was refused "
            "(the lease expired and moved on, or the task was cancelled or past its deadline).",
            registry=self.registry,
        )
        self.handler_seconds = Histogram(
            "outbox_worker_handler_seconds",
            "Time in the handler, per task.",
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)

    def watch(self, database: Callable[[], object | None], running: Callable[[], int]) -> None:
        """Add the scrape-time gauges: database up (`database` is a Probe) and running tasks."""
        self.registry.register(DatabaseUp("outbox_worker_database_up", database))
        self.registry.register(_Running(running))

    def claimed(self, count: int) -> None:
        """Count claimed tasks."""
        self.claims.inc(count)

    def outcome(self, kind: str) -> None:
        """Count one task's outcome."""
        self.outcomes.labels(kind).inc()

    def lease_lost(self) -> None:
        """Count a lease lost under a running handler."""
        self.lease_losses.inc()

    def handled(self, seconds: float) -> None:
        """Record one handler call's duration."""
        self.handler_seconds.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
