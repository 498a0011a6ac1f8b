"""The otel extra: with OpenTelemetry's API installed, publish() stores the active span's
trace context; without it, nothing (and nothing fails)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sqlalchemy.orm import Session

import outbox

TRACE_ID, SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-01"


def test_publish_stores_the_active_spans_context_when_the_api_is_installed(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    outbox.upgrade(url)
    engine = outbox.create_engine(url)
    try:
        with Session(engine) as session:
            if importlib.util.find_spec("opentelemetry") is None:
                row = outbox.publish(session, "billing", "untraced", {"n": 1})
                assert row["headers"] == {}
                return
            from opentelemetry import trace

            parent = trace.SpanContext(
                TRACE_ID, SPAN_ID, is_remote=True, trace_flags=trace.TraceFlags(1)
            )
            with trace.use_span(trace.NonRecordingSpan(parent)):
                row = outbox.publish(session, "billing", "traced", {"n": 1})
            assert row["headers"] == {"traceparent": TRACEPARENT}
    finally:
        engine.dispose()
