"""A task run's span: linked to the task's creation context, current in the handler, and
the creation context of the task's reply (outbox.executor, outbox.tracing)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from support.cli_helpers import running_in_thread
from support.tracing import named, refuse_tracing, spans, traceparent_of
from support.worker_tasks import SOURCE, real_time_queue, submit, wait_until

from outbox import Claim, Envelope, TaskQueue
from outbox.worker import PermanentFailure, Worker

__all__ = ["spans"]  # the fixture, used by name

RUN = "process outbox_tasks"


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the database clock: the worker's heartbeats run in real time."""
    yield from real_time_queue(db_url)


@pytest.mark.parametrize("kind", ["thread", "async"])
def test_a_run_links_its_creation_and_its_reply_continues_the_run(
    queue: TaskQueue, spans: InMemorySpanExporter, kind: str
) -> None:
    tracer = trace.get_tracer("tests.worker_tracing")
    with tracer.start_as_current_span("POST /tasks") as received:
        done, failed = submit(queue, 2)
    untraced = queue.receive(
        SOURCE, Envelope("untraced", "agent-a", {"n": 9}, time.time() + 3600)
    ).task_id
    inside: dict[str, trace.SpanContext] = {}

    def run(claim: Claim) -> dict[str, Any]:
        # The handler's own spans nest under the run: the run's span is current here.
        with tracer.start_as_current_span("handler's own") as own:
            inside[claim.task_id] = own.get_span_context()
        if claim.task_id == failed:
            raise PermanentFailure("bad input")
        return {"n": claim.payload["n"]}

    if kind == "thread":

        def handler(claim: Claim, stop: threading.Event) -> dict[str, Any]:
            return run(claim)

        worker = Worker(queue, handler, concurrency=2, poll_interval=0.05)
    else:

        async def async_handler(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
            return run(claim)

        worker = Worker(queue, async_handler, concurrency=2, poll_interval=0.05)
    ids = [done, failed, untraced]
    with running_in_thread(worker):
        assert wait_until(
            lambda: [queue.task(i)["state"] for i in ids] == ["done", "failed", "done"]  # type: ignore[index]
        )
    finished = spans.get_finished_spans()
    runs = {span.attributes["messaging.message.id"]: span for span in named(finished, RUN)}  # type: ignore[index]
    assert set(runs) == set(ids)
    creation = received.get_span_context()
    for task_id, span in runs.items():
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is None  # linked, not continued
        linked = [(link.context.trace_id, link.context.span_id) for link in span.links]
        expected = [] if task_id == untraced else [(creation.trace_id, creation.span_id)]
        assert linked == expected
        assert span.attributes["outbox.task.attempt"] == 1  # type: ignore[index]
        own = named(finished, "handler's own")
        assert any(o.parent is not None and o.parent.span_id == span.context.span_id for o in own)
    assert runs[failed].status.status_code is StatusCode.ERROR
    assert runs[done].status.status_code is StatusCode.UNSET
    replies = {row["task_id"]: row["headers"] for row in queue.messages()}
    for task_id in ids:
        # Each reply's creation context is the run's: the reply's trace continues it.
        assert replies[task_id] == {"traceparent": traceparent_of(runs[task_id].context)}


def test_unconfigured_a_run_records_nothing_and_replies_carry_no_context(
    queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    touched = refuse_tracing(monkeypatch)
    (task_id,) = submit(queue, 1)

    def handler(claim: Claim, stop: threading.Event) -> str:
        assert not trace.get_current_span().get_span_context().is_valid
        return "ok"

    with running_in_thread(Worker(queue, handler, concurrency=1, poll_interval=0.05)):
        assert wait_until(lambda: queue.task(task_id)["state"] == "done")  # type: ignore[index]
    assert [row["headers"] for row in queue.messages()] == [{}]
    assert touched == []  # no span made, no context read
