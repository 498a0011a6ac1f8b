"""One trace across real processes, exported over OTLP/HTTP as docs/how-to/tracing.md says.

The relay, the receiver and the worker run as the `outbox` command under the standard
`opentelemetry-instrument` wrapper, configured by `OTEL_*` variables alone, and export to
a collector stand-in (support.otlp_collector) that decodes what they post. The test
process is the publisher: its own SDK exports its `POST /orders` span to the same
stand-in. The relay and the receiver hold their spans until they stop (the batch
processor's delay outlasts the test), so what arrives from them came from the flush at
their exit on SIGTERM; the worker exports while it runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanContext, SpanKind, Tracer
from sqlalchemy.orm import Session
from support.otlp_collector import OtlpCollector, ReceivedSpan, otlp_collector
from support.processes import PROCESS_EXIT, PROCESS_START, spawned
from support.receiver_helpers import ROOT, SECRET, free_port, signed, wait_until
from support.relay_helpers import rows
from support.tracing import set_global_for_the_test
from support.worker_tasks import real_time_queue, submit

import outbox
from outbox import TaskQueue

pytestmark = pytest.mark.postgresql_only

BIN = Path(sys.executable).parent
PUBLISHER, RELAY, RECEIVER, WORKER = "orders", "orders-relay", "billing-receiver", "orders-worker"
HELD = 600_000
"""OTEL_BSP_SCHEDULE_DELAY (ms) of a process whose spans must wait for its exit: longer
than any test may run, so none is exported on the batch processor's schedule."""
PROMPT = 100
"""OTEL_BSP_SCHEDULE_DELAY (ms) of a process that exports while it runs."""


@pytest.fixture
def backend() -> str:
    """PostgreSQL: the relay and the worker wake on NOTIFY, and three processes share it."""
    return "postgresql"


@pytest.fixture
def collector() -> Iterator[OtlpCollector]:
    """The collector stand-in every process of the test exports to."""
    with otlp_collector() as running:
        yield running


@pytest.fixture
def publisher(collector: OtlpCollector, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tracer]:
    """The test process's tracer, exporting each span over OTLP as it ends."""
    provider = TracerProvider(resource=Resource.create({"service.name": PUBLISHER}))
    exporter = OTLPSpanExporter(endpoint=f"{collector.endpoint}/v1/traces")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_global_for_the_test(provider, monkeypatch)
    yield provider.get_tracer("tests.orders")
    provider.shutdown()


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the database clock, as the worker's."""
    yield from real_time_queue(db_url)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """The signing secret the relay signs with and the receiver checks."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return path


class Traced:
    """An `outbox` command under `opentelemetry-instrument`, its output in a file."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def text(self) -> str:
        """What it logged so far."""
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        """True while it runs; AssertionError, with its log, once it has ended."""
        if self.proc.poll() is not None:
            raise AssertionError(f"exited with {self.proc.returncode}:\n{self.text()}")
        return True

    def stop(self) -> None:
        """SIGTERM, then the exit status must be 0: a graceful stop."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout=PROCESS_EXIT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after SIGTERM:\n{self.text()}") from None
        assert status == 0, self.text()


@contextmanager
def traced(
    tmp_path: Path, collector: OtlpCollector, service: str, delay: int, *argv: str
) -> Iterator[Traced]:
    """`opentelemetry-instrument outbox *argv` as `service`, exporting to `collector` with
    a batch processor that exports every `delay` ms; killed and reaped on the way out."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("OUTBOX", "OTEL_"))
    }
    environment.update(
        PYTHONPATH=str(ROOT / "tests"),  # the worker's handler
        OTEL_SERVICE_NAME=service,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_BSP_SCHEDULE_DELAY=str(delay),
    )
    if service == RELAY:
        environment["OTEL_EXPORTER_OTLP_COMPRESSION"] = "gzip"  # as a collector may ask
    # `--`: the wrapper would take the relay's `--config` for a prefix of its own options.
    command = [str(BIN / "opentelemetry-instrument"), "--", str(BIN / "outbox"), *argv]
    log = tmp_path / f"{service}.log"
    with (
        log.open("wb") as sink,
        spawned(command, cwd=ROOT, env=environment, stdout=sink, stderr=subprocess.STDOUT) as proc,
    ):
        yield Traced(proc, log)


def healthy(port: int, process: Traced) -> bool:
    """Whether the receiver on `port` answers its health check (fails once it has ended)."""
    process.running()
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def relay_config(tmp_path: Path, port: int, secret_file: Path) -> Path:
    """The relay's file: the receiver on `port` as destination `billing`, in single mode."""
    lines = [
        "[relay]",
        "lease = 10",
        "poll_interval = 0.1",
        "[destinations.billing]",
        f'url = "http://127.0.0.1:{port}/replies"',
        f'secret_file = "{secret_file}"',
        "timeout = 5",
        'mode = "single"',
    ]
    path = tmp_path / "relay.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ids_of(context: SpanContext) -> tuple[str, str]:
    """A span context's trace and span ids, as the collector shows them."""
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def one(spans: Sequence[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    """The one span `name` that `service` exported (AssertionError if not exactly one)."""
    found = [span for span in spans if (span.service, span.name) == (service, name)]
    assert len(found) == 1, [(span.service, span.name) for span in spans]
    return found[0]


def exported(*wanted: tuple[str, str]) -> Callable[[Sequence[ReceivedSpan]], bool]:
    """A condition for wait_for: each (service, span name) has arrived."""

    def arrived(spans: Sequence[ReceivedSpan]) -> bool:
        return set(wanted) <= {(span.service, span.name) for span in spans}

    return arrived


def publish_order(publisher: Tracer, engine: sa.Engine) -> SpanContext:
    """Publish `order-1:created` to `billing` as a request handler does: inside the span of
    its `POST /orders`, whose context it returns."""
    with (
        publisher.start_as_current_span("POST /orders", kind=SpanKind.SERVER) as request,
        Session(engine) as session,
        session.begin(),
    ):
        outbox.publish(session, "billing", "order-1:created", {"order": 1})
    return request.get_span_context()


def test_the_publisher_relay_and_receiver_spans_are_one_trace(
    db_url: str,
    collector: OtlpCollector,
    publisher: Tracer,
    secret_file: Path,
    tmp_path: Path,
) -> None:
    port = free_port()
    receiver_argv = ["receiver", "--db", db_url, "--port", str(port)]
    receiver_argv += ["--secret-file", str(secret_file), "--continue-traces"]
    config = relay_config(tmp_path, port, secret_file)
    relay_argv = ["relay", "--db", db_url, "--config", str(config)]
    engine = outbox.create_engine(db_url)
    try:
        with traced(tmp_path, collector, RECEIVER, HELD, *receiver_argv) as receiver:
            wait_until(lambda: healthy(port, receiver), PROCESS_START, "the receiver")
            with traced(tmp_path, collector, RELAY, HELD, *relay_argv) as relay:
                request = publish_order(publisher, engine)
                wait_until(
                    lambda: relay.running() and rows(engine)["order-1:created"]["state"] == "sent",
                    PROCESS_START,
                    "the delivery",
                )
                # Sent and stored, and neither process has exported a span yet: what comes
                # from them below comes from their flush on the way out.
                assert {span.service for span in collector.spans()} == {PUBLISHER}
                relay.stop()
            receiver.stop()
    finally:
        engine.dispose()
    spans = collector.wait_for(
        exported((RELAY, "send billing"), (RECEIVER, "process replies")),
        PROCESS_EXIT,
        "the relay's and the receiver's spans",
    )
    trace_id, request_id = ids_of(request)
    posted = one(spans, PUBLISHER, "POST /orders")
    send = one(spans, RELAY, "send billing")
    process = one(spans, RECEIVER, "process replies")
    assert {posted.trace_id, send.trace_id, process.trace_id} == {trace_id}
    assert posted.span_id == request_id
    # The relay carries the message's creation context unchanged (the publisher's span):
    # its send continues it, and the receiver's process (--continue-traces) too.
    assert send.parent_span_id == request_id
    assert process.parent_span_id == request_id
    assert (send.kind, send.scope) == ("producer", "outbox")
    assert send.attributes["messaging.message.id"] == "order-1:created"
    assert send.attributes["messaging.destination.name"] == "billing"
    assert send.attributes["messaging.system"] == "webhook"
    assert send.attributes["http.response.status_code"] == 200
    assert (process.kind, process.scope) == ("consumer", "outbox")
    assert process.attributes["messaging.message.id"] == "order-1:created"
    assert process.attributes["outbox.dedupe.outcome"] == "stored"
    assert collector.refused == []


def test_a_worker_run_links_its_task_and_its_reply_continues_the_run(
    db_url: str, queue: TaskQueue, collector: OtlpCollector, publisher: Tracer, tmp_path: Path
) -> None:
    with publisher.start_as_current_span("POST /tasks", kind=SpanKind.SERVER) as request:
        (task_id,) = submit(queue, 1)
    argv = ["worker", "--db", db_url, "--handler", "support.worker_handlers:double"]
    with traced(tmp_path, collector, WORKER, PROMPT, *argv, "--poll-interval", "0.1") as worker:
        wait_until(
            lambda: worker.running() and queue.task(task_id)["state"] == "done",  # type: ignore[index]
            PROCESS_START,
            "the task's run",
        )
        spans = collector.wait_for(
            exported((WORKER, "process outbox_tasks")), PROCESS_START, "the run's span"
        )
        worker.stop()
    (reply,) = queue.messages()
    run = one(spans, WORKER, "process outbox_tasks")
    assert (run.kind, run.scope, run.parent_span_id) == ("consumer", "outbox", None)
    # Linked to the context the task was received in, not continuing it.
    assert run.links == (ids_of(request.get_span_context()),)
    assert run.trace_id != ids_of(request.get_span_context())[0]
    assert run.attributes["messaging.message.id"] == task_id
    assert run.attributes["outbox.task.handler"] == "support.worker_handlers:double"
    # The reply's creation context is the run's: its delivery continues the run's trace.
    assert reply["task_id"] == task_id
    assert list(reply["headers"]) == ["traceparent"]
    version, trace_id, span_id, _ = reply["headers"]["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", run.trace_id, run.span_id)
    assert collector.refused == []


def test_the_spans_of_a_receiver_with_worker_processes_are_flushed_when_it_stops(
    db_url: str, collector: OtlpCollector, secret_file: Path, tmp_path: Path
) -> None:
    port = free_port()
    argv = ["receiver", "--db", db_url, "--port", str(port), "--secret-file", str(secret_file)]
    argv += ["--workers", "2", "--continue-traces"]
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    body = b'{"order": 2}'
    headers = {**signed("order-2:created", body), "traceparent": f"00-{trace_id}-{span_id}-01"}
    with traced(tmp_path, collector, RECEIVER, HELD, *argv) as receiver:
        wait_until(lambda: healthy(port, receiver), PROCESS_START, "the receiver")
        answer = httpx.post(
            f"http://127.0.0.1:{port}/replies", content=body, headers=headers, timeout=30
        )
        assert answer.status_code == 200, answer.text
        assert collector.spans() == []  # held by the worker process that answered
        receiver.stop()
    spans = collector.wait_for(
        exported((RECEIVER, "process replies")), PROCESS_EXIT, "the answering worker's span"
    )
    process = one(spans, RECEIVER, "process replies")
    assert (process.trace_id, process.parent_span_id) == (trace_id, span_id)
    assert process.attributes["outbox.dedupe.outcome"] == "stored"
