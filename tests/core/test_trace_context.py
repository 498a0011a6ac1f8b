"""A message's creation context: publish() inside a span stores the span's trace context."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from support.async_urls import async_url

import outbox.asyncio
from outbox import AuthContext, Envelope, TaskQueue, publish, trace_context
from outbox.testing import ManualClock

TRACER = TracerProvider().get_tracer("tests.trace_context")
EXPLICIT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def published(queue: TaskQueue, clock: ManualClock, reply_id: str, **fields: Any) -> dict[str, str]:
    """Publish and commit one message; the headers stored with it."""
    with Session(queue.engine) as session:
        row = publish(session, "billing", reply_id, {"n": 1}, clock=clock, **fields)
        session.commit()
    return dict(row["headers"])


def traceparent_of(span: trace.Span) -> str:
    """The W3C traceparent of a span."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def test_without_a_span_nothing_is_stored(queue: TaskQueue, clock: ManualClock) -> None:
    assert published(queue, clock, "quiet") == {}


def test_inside_a_span_its_traceparent_is_stored(queue: TaskQueue, clock: ManualClock) -> None:
    with TRACER.start_as_current_span("POST /orders") as span:
        headers = published(queue, clock, "traced")
    assert headers == {"traceparent": traceparent_of(span)}


def test_the_spans_tracestate_is_stored_with_it(queue: TaskQueue, clock: ManualClock) -> None:
    state = TraceState([("vendor", "opaque-value")])
    parent = SpanContext(0x1F, 0x2E, is_remote=True, trace_flags=TraceFlags(1), trace_state=state)
    with trace.use_span(NonRecordingSpan(parent)):
        headers = published(queue, clock, "with-state")
    assert headers == {
        "traceparent": f"00-{0x1F:032x}-{0x2E:016x}-01",
        "tracestate": "vendor=opaque-value",
    }


def test_an_explicit_traceparent_wins(queue: TaskQueue, clock: ManualClock) -> None:
    with TRACER.start_as_current_span("POST /orders"):
        assert published(queue, clock, "explicit", traceparent=EXPLICIT) == {
            "traceparent": EXPLICIT
        }
        own = {"TraceParent": EXPLICIT, "x-a": "1"}
        assert published(queue, clock, "own-header", headers=own) == own


def test_the_context_is_outside_the_callers_header_budget(
    queue: TaskQueue, clock: ManualClock
) -> None:
    full = {f"x-h{n}": "v" for n in range(32)}
    with TRACER.start_as_current_span("POST /orders") as span:
        headers = published(queue, clock, "full", headers=full)
    assert headers == {**full, "traceparent": traceparent_of(span)}


def test_async_publish_inside_a_span_stores_it(db_url: str, queue: TaskQueue) -> None:
    async def scenario() -> tuple[dict[str, str], str]:
        engine = create_async_engine(async_url(db_url))
        try:
            with TRACER.start_as_current_span("POST /orders") as span:
                async with AsyncSession(engine) as session, session.begin():
                    row = await outbox.asyncio.publish(session, "billing", "async", {"n": 1})
            return dict(row["headers"]), traceparent_of(span)
        finally:
            await engine.dispose()

    headers, expected = asyncio.run(scenario())
    assert headers == {"traceparent": expected}


def envelope(message_id: str, clock: ManualClock) -> Envelope:
    """An envelope from agent-a due within the hour."""
    return Envelope(
        message_id=message_id, sender="agent-a", payload={"n": 1}, deadline=clock() + 3600
    )


def test_a_task_received_inside_a_span_keeps_its_context(
    queue: TaskQueue, clock: ManualClock
) -> None:
    auth = AuthContext("agent-a")
    outside = queue.receive(auth, envelope("outside", clock))
    with TRACER.start_as_current_span("POST /tasks") as span:
        inside = queue.receive(auth, envelope("inside", clock))
        with Session(queue.engine) as session:
            in_tx = queue.receive_tx(session, auth, envelope("in-tx", clock))
            session.commit()
    for ack, expected in (
        (outside, None),
        (inside, traceparent_of(span)),
        (in_tx, traceparent_of(span)),
    ):
        task = queue.task(ack.task_id)
        assert task is not None
        assert (task["traceparent"], task["tracestate"]) == (expected, None)


@pytest.fixture
def without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """opentelemetry as if it were not installed, for the readers made meanwhile."""
    trace_context.otel_trace.cache_clear()
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    yield
    trace_context.otel_trace.cache_clear()


@pytest.mark.usefixtures("without_opentelemetry")
def test_without_opentelemetry_nothing_is_stored(queue: TaskQueue, clock: ManualClock) -> None:
    with TRACER.start_as_current_span("POST /orders"):
        assert trace_context.active_context() == {}
        assert published(queue, clock, "no-otel") == {}
