"""The creation context of a message: the W3C trace context of the span that published it.

OpenTelemetry's messaging conventions give each message the context of the operation
that created it, which later hops link to or continue. publish() stores the active
span's `traceparent` and `tracestate` with the message (among its headers, which every
delivery carries), so the destination's trace joins the publisher's. opentelemetry-api
is optional (the `otel` extra): without it, or with no valid span active (no tracer
provider configured), nothing is stored and nothing is spent beyond one lookup.
"""

from __future__ import annotations

import functools
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACESTATE = 512
"""W3C Trace Context: a tracestate longer than this may be dropped whole."""


def active_context() -> dict[str, str]:
    """The active span's traceparent (and tracestate, if any); {} without a valid span."""
    api = otel_trace()
    if api is None or not api.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagator().inject(carrier)
    if len(carrier.get(TRACESTATE, "")) > MAX_TRACESTATE:
        del carrier[TRACESTATE]
    return {name: carrier[name] for name in (TRACEPARENT, TRACESTATE) if carrier.get(name)}


@functools.cache
def otel_trace() -> Any:
    """The opentelemetry.trace module, or None when opentelemetry-api is not installed."""
    try:
        from opentelemetry import trace
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("opentelemetry"):
            raise
        return None
    return trace


@functools.cache
def propagator() -> Any:
    """The W3C Trace Context propagator (needs opentelemetry-api)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()
