"""Spans of the real OpenTelemetry SDK, collected in memory for one test.

The `spans` fixture sets an SDK tracer provider as the global one for the test alone and
hands over its in-memory exporter: every span the toolkit ends meanwhile is there. The
API lets a process set its global provider once; the test resets it afterwards, as
OpenTelemetry's own test base does, so that the tests after it run unconfigured again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext
from opentelemetry.util._once import Once

TRACE_ID, SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-01"
"""A creation context as a publisher's span would leave it."""


def traceparent(trace_id: int, span_id: int) -> str:
    """A sampled W3C traceparent of these ids."""
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def traceparent_of(context: SpanContext) -> str:
    """The W3C traceparent of a span context."""
    flags = int(context.trace_flags)
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"


def ids(context: SpanContext | None) -> tuple[int, int] | None:
    """A span context's trace and span ids (None for no context: a root span's parent)."""
    return None if context is None else (context.trace_id, context.span_id)


def linked(span: ReadableSpan) -> list[tuple[int, int]]:
    """The trace and span ids of each span a span links to, in order."""
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def exporting_for_the_test(
    provider: TracerProvider, monkeypatch: pytest.MonkeyPatch
) -> InMemorySpanExporter:
    """Make `provider` global for the test, exporting each ended span at once to the
    in-memory exporter returned."""
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_global_for_the_test(provider, monkeypatch)
    return exporter


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The exporter of the test's own global tracer provider (ended spans, at once)."""
    provider = TracerProvider()
    yield exporting_for_the_test(provider, monkeypatch)
    provider.shutdown()


def set_global_for_the_test(provider: TracerProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `provider` the global tracer provider until `monkeypatch` is undone."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    trace.set_tracer_provider(provider)


def named(finished: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    """The finished spans called `name`, in the order they ended."""
    return [span for span in finished if span.name == name]


def refuse_tracing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the toolkit's span making and context reading (outbox.tracing.operation and
    its propagator) fail the caller, and note each use in the list returned: with no
    tracer provider configured, nothing may reach them."""
    from outbox import tracing

    touched: list[str] = []

    def refused(name: str) -> Callable[..., Any]:
        def use(*args: object, **kwargs: object) -> Any:
            touched.append(name)
            raise AssertionError(f"tracing.{name} used with no tracer provider configured")

        return use

    for name in ("operation", "propagator"):
        monkeypatch.setattr(tracing, name, refused(name))
    return touched
