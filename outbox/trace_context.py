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
from collections.abc import Callable

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACESTATE = 512
"""W3C Trace Context: a tracestate longer than this may be dropped whole."""


def active_context() -> dict[str, str]:
    """The active span's traceparent (and tracestate, if any); {} without a valid span."""
    return _reader()()


@functools.cache
def _reader() -> Callable[[], dict[str, str]]:
    """The creation context's reader: OpenTelemetry's, or one that finds none."""
    try:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("opentelemetry"):
            raise
        return dict
    propagator = TraceContextTextMapPropagator()

    def read() -> dict[str, str]:
        if not trace.get_current_span().get_span_context().is_valid:
            return {}
        carrier: dict[str, str] = {}
        propagator.inject(carrier)
        if len(carrier.get(TRACESTATE, "")) > MAX_TRACESTATE:
            del carrier[TRACESTATE]
        return {name: carrier[name] for name in (TRACEPARENT, TRACESTATE) if carrier.get(name)}

    return read
