"""The toolkit's spans (outbox.tracing): parents, links, failures, and nothing unconfigured."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode
from support.tracing import (
    SPAN_ID,
    TRACE_ID,
    TRACEPARENT,
    exporting_for_the_test,
    named,
    set_global_for_the_test,
    spans,
    traceparent,
)

from outbox import trace_context, tracing

__all__ = ["spans"]  # the fixture, used by name

OTHER = traceparent(0x1234, 0x5678)


def test_one_context_is_the_parent(spans: InMemorySpanExporter) -> None:
    with tracing.operation("send a", tracing.PRODUCER, {"n": 1}, [{"traceparent": TRACEPARENT}]):
        pass
    (span,) = named(spans.get_finished_spans(), "send a")
    assert span.kind is SpanKind.PRODUCER
    assert span.parent is not None
    assert (span.parent.trace_id, span.parent.span_id) == (TRACE_ID, SPAN_ID)
    assert span.context.trace_id == TRACE_ID
    assert not span.links
    assert dict(span.attributes or {}) == {"n": 1}


def test_several_contexts_are_links_of_a_new_trace(spans: InMemorySpanExporter) -> None:
    contexts = [{"traceparent": TRACEPARENT}, {}, {"traceparent": OTHER}, {"traceparent": "junk"}]
    with tracing.operation("send b", tracing.PRODUCER, {}, contexts):
        pass
    (span,) = named(spans.get_finished_spans(), "send b")
    assert span.parent is None
    assert span.context.trace_id not in (TRACE_ID, 0x1234)
    # The message without a context and the unreadable one are left out.
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
        (TRACE_ID, SPAN_ID),
        (0x1234, 0x5678),
    ]


def test_one_context_is_a_link_when_not_parented(spans: InMemorySpanExporter) -> None:
    contexts = [{"traceparent": TRACEPARENT}]
    with tracing.operation("process c", tracing.CONSUMER, {}, contexts, parented=False):
        pass
    (span,) = named(spans.get_finished_spans(), "process c")
    assert span.kind is SpanKind.CONSUMER
    assert span.parent is None
    assert [link.context.span_id for link in span.links] == [SPAN_ID]


def test_a_failure_and_an_annotation_are_recorded(spans: InMemorySpanExporter) -> None:
    with tracing.operation("send d", tracing.PRODUCER, {}) as span:
        tracing.annotate({"http.response.status_code": 503})
        span.fail("503", "HTTP 503: busy")
    (ended,) = named(spans.get_finished_spans(), "send d")
    assert ended.status.status_code is StatusCode.ERROR
    assert ended.status.description == "HTTP 503: busy"
    assert dict(ended.attributes or {}) == {"http.response.status_code": 503, "error.type": "503"}


def test_an_exception_leaving_the_block_fails_the_span(spans: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError), tracing.operation("process e", tracing.CONSUMER, {}):
        raise RuntimeError("boom")
    (ended,) = named(spans.get_finished_spans(), "process e")
    assert ended.status.status_code is StatusCode.ERROR
    assert [event.name for event in ended.events] == ["exception"]


def test_the_spans_own_context_is_a_creation_context(spans: InMemorySpanExporter) -> None:
    with tracing.operation("process f", tracing.CONSUMER, {}) as span:
        created = span.creation_context()
        assert created == trace_context.active_context()
    (ended,) = named(spans.get_finished_spans(), "process f")
    own = ended.context
    assert created == {
        "traceparent": f"00-{own.trace_id:032x}-{own.span_id:016x}-{int(own.trace_flags):02x}"
    }


def test_unconfigured_nothing_records_and_nothing_is_read() -> None:
    assert not tracing.configured()
    with tracing.operation("send g", tracing.PRODUCER, {}, [{"traceparent": "junk"}]) as span:
        tracing.annotate({"x": 1})
        span.fail("x", "not recorded")
        assert not span.recording
        assert span.creation_context() == {}


def test_without_opentelemetry_nothing_records(monkeypatch: pytest.MonkeyPatch) -> None:
    trace_context.otel_trace.cache_clear()
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    try:
        assert not tracing.configured()
        with tracing.operation("send h", tracing.PRODUCER, {}) as span:
            assert span is tracing.NOT_RECORDING
    finally:
        monkeypatch.undo()
        trace_context.otel_trace.cache_clear()


def test_a_span_sampled_out_still_gives_its_context_on(monkeypatch: pytest.MonkeyPatch) -> None:
    set_global_for_the_test(TracerProvider(sampler=ALWAYS_OFF), monkeypatch)
    with tracing.operation("process i", tracing.CONSUMER, {}) as span:
        assert not span.recording
        created = span.creation_context()
    # What the operation writes carries the trace on, with its decision: not sampled.
    _version, trace_id, span_id, flags = created["traceparent"].split("-")
    assert int(trace_id, 16)
    assert int(span_id, 16)
    assert int(flags, 16) & 0x01 == 0  # the sampled flag is off


class FailingProvider(TracerProvider):
    """An SDK whose spans cannot start: a tracer's fault, not the operation's."""

    def get_tracer(self, *args: object, **kwargs: object) -> FailingTracer:  # type: ignore[override]
        return FailingTracer()


class FailingTracer:
    def start_as_current_span(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("exporter misconfigured")


def test_a_tracer_that_fails_leaves_the_operation_untraced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    set_global_for_the_test(FailingProvider(), monkeypatch)
    ran = []
    with tracing.operation("send j", tracing.PRODUCER, {}) as span:
        ran.append(span.recording)
    assert ran == [False]
    assert "a span could not start" in caplog.text
    # The operation's own error still leaves as it is.
    with pytest.raises(KeyError), tracing.operation("send k", tracing.PRODUCER, {}):
        raise KeyError("the operation's")


@pytest.mark.parametrize(
    ("limits", "kept"),
    [
        (None, 128),
        (SpanLimits(max_links=5), 5),
        (SpanLimits(max_links=0), 0),
        (SpanLimits(max_links=SpanLimits.UNSET), 300),  # no bound: every context
    ],
)
def test_a_span_links_the_first_contexts_up_to_the_sdks_bound(
    monkeypatch: pytest.MonkeyPatch, limits: SpanLimits | None, kept: int
) -> None:
    provider = TracerProvider(span_limits=limits) if limits else TracerProvider()
    exporter = exporting_for_the_test(provider, monkeypatch)
    contexts = [{"traceparent": traceparent(n + 1, n + 1)} for n in range(300)]
    with tracing.operation("send l", tracing.PRODUCER, {}, contexts):
        pass
    (span,) = named(exporter.get_finished_spans(), "send l")
    # The first ones, in the order given: the rest are never read.
    assert [link.context.trace_id for link in span.links] == list(range(1, kept + 1))
