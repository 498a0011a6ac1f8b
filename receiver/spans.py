"""The receiver's `process` spans: one per request or fetched batch, with its outcomes.

A span names what it processed (OpenTelemetry's messaging attributes) and is linked to
each message's creation context, the traceparent the publisher stored with it; a single
message's span may instead continue the publisher's trace (`continue_traces`), which
makes a trace of publisher, relay and receiver one tree. The dedupe outcome of a single
message is its `outbox.dedupe.outcome`; a batch counts its items per outcome
(`outbox.dedupe.<outcome>`). Nothing is read or built unless tracing is set up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from outbox import tracing
from outbox.trace_context import TRACEPARENT, TRACESTATE

HTTP_SYSTEM = "webhook"
"""`messaging.system` of the HTTP receiver's spans (as of the relay's HTTP send spans)."""
OUTCOME = "outbox.dedupe.outcome"


def creation_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The creation context among a message's headers (names in lowercase)."""
    return {name: headers[name] for name in (TRACEPARENT, TRACESTATE) if name in headers}


@contextmanager
def processing(
    system: str,
    source: str,
    reply_ids: Sequence[str],
    contexts: Sequence[Mapping[str, str]],
    *,
    continue_traces: bool = False,
    start_time: int | None = None,
) -> Iterator[tracing.Span]:
    """The `process {source}` span of the messages `reply_ids` (one for a single message;
    none when they cannot be named), linked to `contexts` (or, with `continue_traces` and
    one message, its child); `start_time` (epoch nanoseconds) when the request began
    before its contexts were read."""
    attributes: dict[str, str | int | float | bool] = {
        "messaging.system": system,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": source,
    }
    if len(reply_ids) == 1:
        attributes["messaging.message.id"] = reply_ids[0]
    elif reply_ids:
        attributes["messaging.batch.message_count"] = len(reply_ids)
    with tracing.operation(
        f"process {source}",
        tracing.CONSUMER,
        attributes,
        contexts,
        parented=continue_traces and len(contexts) == 1,
        start_time=start_time,
    ) as span:
        yield span


def record_outcomes(span: tracing.Span, outcomes: Sequence[str]) -> None:
    """Each message's dedupe outcome on its span: the one outcome, or counts by outcome."""
    if not span.recording:
        return
    if len(outcomes) == 1:
        span.set({OUTCOME: outcomes[0]})
        return
    counts: dict[str, str | int | float | bool] = {
        f"outbox.dedupe.{outcome}": count for outcome, count in Counter(outcomes).items()
    }
    counts["messaging.batch.message_count"] = len(outcomes)
    span.set(counts)
