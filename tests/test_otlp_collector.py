"""The collector stand-in (support.otlp_collector) decodes what OTLP/HTTP exporters post."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind
from support.otlp_collector import PROTOBUF, otlp_collector


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_an_exported_span_arrives_with_its_service_ids_kind_attributes_and_links(
    compression: Compression,
) -> None:
    with otlp_collector() as collector:
        provider = TracerProvider(resource=Resource.create({"service.name": "checked"}))
        exporter = OTLPSpanExporter(
            endpoint=f"{collector.endpoint}/v1/traces", compression=compression
        )
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("tests.collector")
        with tracer.start_as_current_span("parent") as parent:
            linked = parent.get_span_context()
            attributes = {"s": "text", "n": 7, "f": 0.5, "b": True, "a": ["x", "y"]}
            with tracer.start_as_current_span(
                "child", kind=SpanKind.PRODUCER, attributes=attributes, links=[Link(linked)]
            ) as child:
                context = child.get_span_context()
        provider.shutdown()
        spans = collector.wait_for(lambda spans: len(spans) == 2, 30, "both spans")
    received = {span.name: span for span in spans}
    got = received["child"]
    assert (got.service, got.scope, got.kind) == ("checked", "tests.collector", "producer")
    assert (got.trace_id, got.span_id) == (f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert got.parent_span_id == f"{linked.span_id:016x}" == received["parent"].span_id
    assert received["parent"].parent_span_id is None
    assert received["parent"].kind == "internal"
    assert got.attributes == attributes
    assert got.links == ((f"{linked.trace_id:032x}", f"{linked.span_id:016x}"),)
    assert collector.refused == []


def test_what_is_not_a_trace_export_is_refused_and_noted() -> None:
    with otlp_collector() as collector:
        traces = f"{collector.endpoint}/v1/traces"
        protobuf = {"content-type": PROTOBUF}
        answers = [
            httpx.post(f"{collector.endpoint}/v1/metrics", content=b"", headers=protobuf),
            httpx.post(traces, content=b"{}", headers={"content-type": "application/json"}),
            httpx.post(traces, content=b"\xff\xff\xff", headers=protobuf),
            httpx.post(traces, content=b"", headers={**protobuf, "content-encoding": "br"}),
        ]
        assert [answer.status_code for answer in answers] == [404, 415, 400, 415]
        assert len(collector.refused) == 4
        assert collector.spans() == []
        with pytest.raises(AssertionError, match="refused"):
            collector.wait_for(lambda spans: bool(spans), 0.1, "a span")
