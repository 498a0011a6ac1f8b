"""Receiver observability: requests by route and status, receipts by outcome, commit time.

The counters sit at the two places every request passes: an ASGI middleware
(route and status, the framework's own 404 and 405 included) and the store
(one `accept_many` per transaction, so its outcomes and duration are the
commit's, whether a group of single messages or a batch). Whether the database
answers is read at scrape time through a Probe.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.observability.database import DatabaseUp
from receiver.effects import Effect
from receiver.rules import Store
from receiver.store import BatchItem, Receipt

OUTCOMES = ("stored", "duplicate", "conflict", "retry", "held")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods counted by name; any other is `other`, so clients cannot grow the label set."""


class ReceiverMetrics:
    """The receiver's counters and histograms in a registry of their own; one per app."""

    def __init__(self) -> None:
        """Create the metrics; create_app adds the database gauge (watch())."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "outbox_receiver_requests",
            "HTTP requests by route (its template, or `unmatched`), method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.receipts = Counter(
            "outbox_receiver_receipts",
            "Messages the store decided on: stored (first time), duplicate (same body "
            "again), conflict (same reply_id, another body), retry (its effect raised: "
            "not stored) or held (an earlier message of its ordering key is retry).",
            ["outcome"],
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "outbox_receiver_commit_seconds",
            "Duration of one transaction storing receipts (a group commit of single "
            "messages, or a batch), retries included.",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.commit_size = Histogram(
            "outbox_receiver_commit_receipts",
            "Receipts stored per transaction: how much the group commit gathers.",
            registry=self.registry,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
        )
        for outcome in OUTCOMES:
            self.receipts.labels(outcome)

    def watch(self, database: Callable[[], object | None]) -> None:
        """Add `outbox_receiver_database_up`, read through `database` (a Probe) at scrape time."""
        self.registry.register(DatabaseUp("outbox_receiver_database_up", database))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


CONSUMED_OUTCOMES = ("stored", "duplicate", "conflict", "invalid", "retry", "held", "dead")


class ConsumerMetrics:
    """A broker consumer's counters in a registry of their own; one per consumer."""

    def __init__(self) -> None:
        """Create the metrics; the command adds the database gauge (watch())."""
        self.registry = CollectorRegistry()
        self.consumed = Counter(
            "outbox_receiver_consumed",
            "Broker messages by outcome: stored, duplicate, conflict (acknowledged), "
            "invalid (refused, never redelivered), retry (not acknowledged: delivered again) "
            "held (not acknowledged: an earlier message of its ordering key is retry) or "
            "dead (its effect raised on its last allowed delivery, or it was dead already: "
            "kept in receiver_dead_letters, acknowledged).",
            ["outcome"],
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "outbox_receiver_consume_commit_seconds",
            "Duration of one transaction storing a fetched batch, effects included.",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        for outcome in CONSUMED_OUTCOMES:
            self.consumed.labels(outcome)
        self.durable_pending = Gauge(
            "outbox_receiver_durable_pending",
            "JetStream: messages of the stream the durable has not delivered yet, at its "
            "last reading (RabbitMQ: 0).",
            registry=self.registry,
        )
        self.durable_ack_pending = Gauge(
            "outbox_receiver_durable_ack_pending",
            "JetStream: messages the durable delivered that no consumer has acknowledged "
            "or terminated yet, at its last reading (RabbitMQ: 0).",
            registry=self.registry,
        )
        self.durable_stalled = Gauge(
            "outbox_receiver_durable_stalled",
            "JetStream: 1 while the durable has messages to deliver or unacknowledged and "
            "its acknowledgement floor has not moved, nor this consumer settled any, for "
            "the stall time (a warning is logged); else 0 (RabbitMQ: 0).",
            registry=self.registry,
        )

    def watch(self, database: Callable[[], object | None]) -> None:
        """Add `outbox_receiver_database_up`, read through `database` (a Probe) at scrape time."""
        self.registry.register(DatabaseUp("outbox_receiver_database_up", database))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class CountingStore:
    """A Store that counts what its `accept_many` decided and how long each commit took."""

    def __init__(self, store: Store, metrics: ReceiverMetrics) -> None:
        """Count into `metrics`; everything else goes to `store`."""
        self.store = store
        self.metrics = metrics
        self.retention = store.retention

    def accept_many(
        self, items: Sequence[BatchItem], effect: Effect | None = None, *, isolate: bool = False
    ) -> list[str]:
        """The wrapped store's accept_many, counted; its answer as it is (`errors` included)."""
        started = time.perf_counter()
        statuses = self.store.accept_many(items, effect, isolate=isolate)
        self.metrics.commit_seconds.observe(time.perf_counter() - started)
        self.metrics.commit_size.observe(len(items))
        # One increment per outcome, not per receipt: a batch holds up to 1,000.
        for status, count in collections.Counter(statuses).items():
            self.metrics.receipts.labels(status).inc(count)
        return statuses

    def lookup(self, reply_id: str) -> Receipt | None:
        """The wrapped store's lookup."""
        return self.store.lookup(reply_id)


class CountRequests:
    """ASGI middleware: counts each HTTP request by route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: ReceiverMetrics) -> None:
        """Count into `metrics`."""
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; count it once its status is known."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # unless a response starts: an exception becomes the server's 500

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            # The router writes the matched route into the scope it was handed.
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.requests.labels(route, method, str(status)).inc()
