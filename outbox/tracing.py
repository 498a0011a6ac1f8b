"""Spans of the toolkit's own operations, after OpenTelemetry's messaging conventions.

The relay's `send`, the receiver's and the consumers' `process` and the worker's task
runs each open one span through operation(). A span names the message contexts it
concerns (their creation contexts, outbox.trace_context): one as its parent, several as
links. opentelemetry-api is optional (the `otel` extra); without it, or with no tracer
provider configured (the API's proxy, before an SDK is set up), operation() yields a
span that records nothing and reads no context: one check per operation. A tracer that
fails is logged and left out: tracing never changes what an operation does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from outbox.trace_context import TRACEPARENT, TRACESTATE, otel_trace, propagator

if TYPE_CHECKING:
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer

log = logging.getLogger("outbox.tracing")

INSTRUMENTATION = "outbox"
"""The instrumentation scope's name: every span of the toolkit comes from it."""

Attributes = Mapping[str, str | int | float | bool]
CreationContext = Mapping[str, str]
"""A message's `traceparent` and `tracestate` (its headers, or a task's columns)."""

PRODUCER, CONSUMER, INTERNAL = "producer", "consumer", "internal"
"""Span kinds, by name: the caller need not import OpenTelemetry."""


class Span:
    """The toolkit's handle on one operation's span; a recording one wraps OpenTelemetry's."""

    recording = False

    def set(self, attributes: Attributes) -> None:
        """Add attributes (kept only by a recording span)."""

    def fail(self, error_type: str, reason: str) -> None:
        """Mark the operation failed: error status with `reason`, `error.type` set."""

    def creation_context(self) -> dict[str, str]:
        """This span's context as a creation context (traceparent, tracestate); {} without
        a span, so that what it writes stays as it was."""
        return {}


NOT_RECORDING = Span()


class _Traced(Span):
    """An OpenTelemetry span; one sampled out records nothing but still has a context,
    which what it writes carries on (with its sampling decision)."""

    def __init__(self, span: OtelSpan) -> None:
        self._span = span
        self.recording = span.is_recording()

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def fail(self, error_type: str, reason: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("error.type", error_type)
        self._span.set_status(Status(StatusCode.ERROR, reason))

    def creation_context(self) -> dict[str, str]:
        from opentelemetry.trace import set_span_in_context

        if not self._span.get_span_context().is_valid:
            return {}
        carrier: dict[str, str] = {}
        propagator().inject(carrier, context=set_span_in_context(self._span))
        return {name: carrier[name] for name in (TRACEPARENT, TRACESTATE) if carrier.get(name)}


@contextmanager
def operation(
    name: str,
    kind: str,
    attributes: Attributes,
    contexts: Sequence[CreationContext] = (),
    *,
    parented: bool = True,
    start_time: int | None = None,
) -> Iterator[Span]:
    """One operation's span, current while the block runs, ended when it leaves.

    `contexts` are the creation contexts the operation concerns: with `parented` and
    exactly one, the span continues that trace (its child); otherwise the span starts
    its own trace, linked to each. `start_time` (epoch nanoseconds) is when the
    operation began, for one whose contexts were read before its span could start. An
    exception leaving the block is recorded on the span, which is then marked failed. A
    span that cannot be started or ended is logged, never raised: the operation goes on
    as if untraced.
    """
    tracer = _tracer()
    if tracer is None:
        yield NOT_RECORDING
        return
    try:
        started = _started(tracer, name, kind, attributes, contexts, parented, start_time)
        span = started.__enter__()
    except Exception:  # noqa: BLE001 - a tracer's fault must not become the operation's
        _failed("start")
        yield NOT_RECORDING
        return
    try:
        yield _Traced(span)
    except BaseException as exc:
        _end(started, exc)
        raise
    _end(started, None)


def _started(
    tracer: Tracer,
    name: str,
    kind: str,
    attributes: Attributes,
    contexts: Sequence[CreationContext],
    parented: bool,
    start_time: int | None,
) -> Any:
    """The context manager of the operation's span, current while entered."""
    from opentelemetry.trace import Link, SpanKind

    parent = None
    links: list[Link] = []
    if parented and len(contexts) == 1:
        parent = propagator().extract(contexts[0])
    else:
        links = [Link(linked) for linked in _span_contexts(contexts)]
    return tracer.start_as_current_span(
        name,
        context=parent,
        kind=SpanKind[kind.upper()],
        attributes=attributes,
        links=links,
        start_time=start_time,
    )


def _end(started: Any, exc: BaseException | None) -> None:
    """End the span (recording `exc`, if any); a tracer's failure is logged, not raised."""
    try:
        if exc is None:
            started.__exit__(None, None, None)
        else:
            started.__exit__(type(exc), exc, exc.__traceback__)
    except Exception as raised:  # noqa: BLE001 - see operation()
        if raised is not exc:
            _failed("end")


def _failed(step: str) -> None:
    """Log a tracer's failure: once with its traceback, then at debug level."""
    first = not _failed_before
    _failed_before.append(step)
    log.log(
        logging.WARNING if first else logging.DEBUG,
        "tracing: a span could not %s; the operation goes on untraced",
        step,
        exc_info=first,
    )


_failed_before: list[str] = []


def configured() -> bool:
    """Whether spans are recorded at all: OpenTelemetry is installed and a tracer provider
    is set up. Callers skip the work of describing an operation when not."""
    return _provider() is not None


def annotate(attributes: Attributes) -> None:
    """Add attributes to the current span, when one records: a detail known deep inside
    an operation (an HTTP status) added to the operation's span."""
    if _provider() is None:
        return
    span = otel_trace().get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def _span_contexts(contexts: Sequence[CreationContext]) -> Iterator[Any]:
    """The valid span contexts among creation contexts (a message may carry none), the
    first link_limit() of them."""
    read = propagator().extract
    get_current_span = otel_trace().get_current_span
    limit = link_limit()
    room = len(contexts) if limit is None else limit
    for context in contexts:
        if room <= 0:
            return
        if TRACEPARENT in context:
            linked = get_current_span(read(context)).get_span_context()
            if linked.is_valid:
                room -= 1
                yield linked


def link_limit() -> int | None:
    """How many message contexts a span links at most: the SDK provider's bound on a span's
    links (128 unless OTEL_SPAN_LINK_COUNT_LIMIT or its SpanLimits say otherwise; None:
    no bound, or a provider that keeps its own). Read past it, the SDK drops them: a batch
    of 1,000 read every context and spent a fifth of the traced drain."""
    # The SDK's limits, as it parsed them; a private attribute, read defensively.
    limits = getattr(_provider(), "_span_limits", None)
    max_links = getattr(limits, "max_links", None)
    return max_links if isinstance(max_links, int) and max_links >= 0 else None


def _tracer() -> Tracer | None:
    """The toolkit's tracer, or None without OpenTelemetry or a configured provider."""
    provider = _provider()
    if provider is None:
        return None
    return _tracer_of(provider)


def _provider() -> Any:
    """The global tracer provider when one is configured; None otherwise."""
    api = otel_trace()
    if api is None:
        return None
    provider = api.get_tracer_provider()
    if isinstance(provider, api.ProxyTracerProvider | api.NoOpTracerProvider):
        return None
    return provider


@functools.cache
def _tracer_of(provider: Any) -> Tracer:
    from outbox import __version__

    tracer: Tracer = provider.get_tracer(INSTRUMENTATION, __version__)
    return tracer
