"""The relay's `send` spans against real destinations (relay.dispatch, docs/how-to/tracing.md).

One span per delivery request: a single message's continues its creation context (the
publisher's span); an HTTP batch's or a broker parcel's starts a trace of its own, linked
to each message's. Every request carries each creation context unchanged, so the
destination's trace joins the publisher's. Unconfigured, the relay reads no context.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from support.nats_helpers import NATS_URL, require_nats, stream_of_this_test
from support.rabbitmq import AMQP_URL, take_all, topology
from support.receiver_helpers import SECRET, refusing_port
from support.relay_helpers import publish_many, rows
from support.scripted_server import Answer, ScriptedServer
from support.served import Served
from support.tracing import (
    TRACEPARENT,
    ids,
    linked,
    named,
    refuse_tracing,
    spans,
    traceparent_of,
)

from outbox import tracing
from outbox.schema import messages
from outbox.testing import ManualClock
from receiver import ReceiptStore, create_app
from receiver.effects import record_effect
from relay import Destination, Relay, make_destination

__all__ = ["spans"]  # the fixture, used by name

SEND = "send orders"
TRACESTATE = "vendor=a1"
MESSAGING = {"messaging.operation.type": "send", "messaging.operation.name": "send"}
MESSAGING |= {"messaging.destination.name": "orders"}
# What a span says does not depend on the store: one backend is enough where it is slow.
sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@contextmanager
def publisher(name: str, tracestate: str | None = None) -> Iterator[SpanContext]:
    """A publisher's span, current in the block; with `tracestate`, under a remote parent
    that carries it (the span's context then carries it too)."""
    parent = None
    if tracestate is not None:
        carrier = {"traceparent": TRACEPARENT, "tracestate": tracestate}
        parent = TraceContextTextMapPropagator().extract(carrier)
    tracer = trace.get_tracer("tests.relay_tracing")
    with tracer.start_as_current_span(name, context=parent) as span:
        yield span.get_span_context()


def publish_traced(
    engine: sa.Engine, reply_ids: Sequence[str], clock: ManualClock, tracestate: str | None = None
) -> dict[str, SpanContext]:
    """Publish each message to `orders` in a publisher's span of its own; each span's context."""
    created: dict[str, SpanContext] = {}
    for reply_id in reply_ids:
        with publisher(f"POST /orders/{reply_id}", tracestate) as context:
            publish_many(engine, [reply_id], destination="orders", clock=clock)
        created[reply_id] = context
    return created


def sent(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    """The relay's send spans to `orders`, in the order they ended."""
    return named(spans.get_finished_spans(), SEND)


def webhook(url: str, **options: object) -> dict[str, Destination]:
    """`orders`, an HTTP destination at `url` signed with the receiver's secret."""
    return {"orders": make_destination(url, secret=SECRET, timeout=5, **options)}  # type: ignore[arg-type]


def test_a_single_message_is_sent_in_a_child_of_its_creation_context(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    spans: InMemorySpanExporter,
) -> None:
    created = publish_traced(engine, ["s-1"], clock)["s-1"]
    url = server.url.replace("://", "://user:pa55@") + "?api_key=tok-3f9a"
    with Relay(db_url, webhook(url), clock=clock) as relay:
        assert relay.dispatch_once() == [("s-1", "sent")]
    (span,) = sent(spans)
    assert span.kind is SpanKind.PRODUCER
    assert ids(span.parent) == ids(created)
    assert linked(span) == []
    assert span.status.status_code is StatusCode.UNSET
    assert dict(span.attributes or {}) == {
        **MESSAGING,
        "messaging.system": "webhook",
        "messaging.message.id": "s-1",
        "http.request.method": "POST",
        "server.address": "127.0.0.1",
        "server.port": server.port,
        "url.full": f"http://user:<redacted>@127.0.0.1:{server.port}/replies?<redacted>",
        "http.response.status_code": 200,
    }
    (request,) = server.received
    assert request.headers["traceparent"] == traceparent_of(created)
    assert "tracestate" not in request.headers


def test_the_receiver_continues_the_publishers_trace_from_the_request(
    db_url: str, engine: sa.Engine, clock: ManualClock, spans: InMemorySpanExporter
) -> None:
    created = publish_traced(engine, ["c-1"], clock, tracestate=TRACESTATE)["c-1"]
    with (
        ReceiptStore(db_url) as store,
        Served(create_app(store, [SECRET], effect=record_effect, continue_traces=True)) as app,
        Relay(db_url, webhook(app.base + "/replies"), clock=clock) as relay,
    ):
        assert relay.dispatch_once() == [("c-1", "sent")]
    (send,) = sent(spans)
    (process,) = named(spans.get_finished_spans(), "process replies")
    # Publisher, relay and receiver: one trace, the publisher's span the parent of both.
    assert ids(send.parent) == ids(process.parent) == ids(created)
    assert process.attributes["outbox.dedupe.outcome"] == "stored"  # type: ignore[index]
    # The receiver read the tracestate too: its span carries it on.
    assert process.context.trace_state.to_header() == TRACESTATE


@sqlite_only
def test_a_batch_is_one_span_linked_to_each_messages_creation_context(
    db_url: str, engine: sa.Engine, clock: ManualClock, spans: InMemorySpanExporter
) -> None:
    created = publish_traced(engine, ["b-1", "b-2"], clock)
    publish_many(engine, ["b-3"], destination="orders", clock=clock)  # outside any span
    with (
        ReceiptStore(db_url) as store,
        Served(create_app(store, [SECRET], effect=record_effect)) as app,
        Relay(db_url, webhook(app.base + "/replies", mode="batch"), clock=clock) as relay,
    ):
        assert sorted(relay.dispatch_once()) == [("b-1", "sent"), ("b-2", "sent"), ("b-3", "sent")]
    (span,) = sent(spans)
    assert span.parent is None
    assert span.context.trace_id not in {c.trace_id for c in created.values()}
    assert linked(span) == [ids(created["b-1"]), ids(created["b-2"])]
    attributes = dict(span.attributes or {})
    assert "messaging.message.id" not in attributes
    assert attributes["messaging.batch.message_count"] == 3
    assert attributes["url.full"] == app.base + "/replies/batch"
    assert attributes["http.response.status_code"] == 200
    # Each item carried its creation context: the receiver linked the same two.
    (process,) = named(spans.get_finished_spans(), "process replies")
    assert linked(process) == linked(span)


@sqlite_only
@pytest.mark.parametrize(("status", "verdict"), [(503, "retry"), (400, "dead")])
def test_a_failed_request_is_an_error_with_the_stored_reason(
    status: int,
    verdict: str,
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    spans: InMemorySpanExporter,
) -> None:
    publish_traced(engine, ["f-1"], clock)
    server.script("f-1", Answer(status=status, body=b"not now"))
    with Relay(db_url, webhook(server.url), clock=clock) as relay:
        assert relay.dispatch_once() == [("f-1", verdict)]
    (span,) = sent(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == rows(engine)["f-1"]["last_error"]
    assert f"HTTP {status}" in (span.status.description or "")
    assert span.attributes["error.type"] == str(status)  # type: ignore[index]
    assert span.attributes["http.response.status_code"] == status  # type: ignore[index]


@sqlite_only
def test_a_request_with_no_answer_is_an_error_of_type_retry(
    db_url: str, engine: sa.Engine, clock: ManualClock, spans: InMemorySpanExporter
) -> None:
    publish_traced(engine, ["n-1"], clock)
    with (
        refusing_port() as port,
        Relay(db_url, webhook(f"http://127.0.0.1:{port}/replies"), clock=clock) as relay,
    ):
        assert relay.dispatch_once() == [("n-1", "retry")]
    (span,) = sent(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == rows(engine)["n-1"]["last_error"]
    assert span.attributes["error.type"] == "retry"  # type: ignore[index]
    assert "http.response.status_code" not in (span.attributes or {})


@sqlite_only
def test_a_batch_answered_200_with_an_item_to_retry_is_an_error_of_type_retry(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    spans: InMemorySpanExporter,
) -> None:
    publish_traced(engine, ["i-1", "i-2"], clock)
    results = [{"reply_id": "i-1", "status": "stored"}, {"reply_id": "i-2", "status": "retry"}]
    server.default = Answer(body=json.dumps({"results": results}).encode())
    destination = webhook(server.url, mode="batch", batch_url=server.url)
    with Relay(db_url, destination, clock=clock) as relay:
        assert sorted(relay.dispatch_once()) == [("i-1", "sent"), ("i-2", "retry")]
    (span,) = sent(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == rows(engine)["i-2"]["last_error"]
    # The request succeeded: its status is no error's type.
    assert span.attributes["error.type"] == "retry"  # type: ignore[index]
    assert span.attributes["http.response.status_code"] == 200  # type: ignore[index]


def a_broker_delivers_one_then_several(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    spans: InMemorySpanExporter,
    destination: Destination,
) -> dict[str, SpanContext]:
    """One message, then three in one parcel, through `destination`; checks both send spans
    and returns every message's creation context."""
    created = publish_traced(engine, ["m-1"], clock, tracestate=TRACESTATE)
    with Relay(db_url, {"orders": destination}, clock=clock) as relay:
        assert relay.dispatch_once() == [("m-1", "sent")]
        created |= publish_traced(engine, ["m-2", "m-3", "m-4"], clock, tracestate=TRACESTATE)
        assert sorted(relay.dispatch_once()) == [(m, "sent") for m in ("m-2", "m-3", "m-4")]
    one, several = sent(spans)
    system = {"messaging.system": destination.kind}
    assert one.kind is several.kind is SpanKind.PRODUCER
    assert ids(one.parent) == ids(created["m-1"])
    assert dict(one.attributes or {}) == {**MESSAGING, **system, "messaging.message.id": "m-1"}
    assert several.parent is None
    assert linked(several) == [ids(created[m]) for m in ("m-2", "m-3", "m-4")]
    count = {"messaging.batch.message_count": 3}
    assert dict(several.attributes or {}) == {**MESSAGING, **system, **count}
    return created


@sqlite_only
def test_nats_send_spans_and_the_context_in_the_message_headers(
    db_url: str, engine: sa.Engine, clock: ManualClock, spans: InMemorySpanExporter
) -> None:
    require_nats()
    with stream_of_this_test() as stream:
        destination = make_destination(
            NATS_URL,
            kind="nats",
            stream=stream.name,
            subject=f"{stream.prefix}.orders",
            secret=SECRET,
            timeout=5,
        )
        created = a_broker_delivers_one_then_several(db_url, engine, clock, spans, destination)
        stored = {m.headers["webhook-id"]: m.headers for m in stream.stored()}
    assert sorted(stored) == sorted(created)
    for reply_id, context in created.items():
        assert stored[reply_id]["traceparent"] == traceparent_of(context)
        assert stored[reply_id]["tracestate"] == TRACESTATE


@sqlite_only
def test_rabbitmq_send_spans_and_the_context_in_the_message_headers(
    db_url: str, engine: sa.Engine, clock: ManualClock, spans: InMemorySpanExporter
) -> None:
    with topology(bindings=["orders.#"]) as made:
        destination = make_destination(
            AMQP_URL,
            kind="rabbitmq",
            exchange=made.exchange,
            routing_key="orders.{ordering_key}",
            secret=SECRET,
            timeout=5,
        )
        created = a_broker_delivers_one_then_several(db_url, engine, clock, spans, destination)
        queued = {m.message_id: m.headers for m in take_all(made.queue)}
    assert sorted(queued) == sorted(created)
    for reply_id, context in created.items():
        assert queued[reply_id]["traceparent"] == traceparent_of(context)
        assert queued[reply_id]["tracestate"] == TRACESTATE


def spoil_the_stored_context(engine: sa.Engine) -> None:
    """Every row's creation context becomes unreadable, as a row written by hand may hold."""
    with engine.begin() as conn:
        conn.execute(sa.update(messages).values(headers='{"traceparent": "junk"}'))


@sqlite_only
def test_an_unreadable_stored_context_is_sent_as_it_is_in_a_trace_of_its_own(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    spans: InMemorySpanExporter,
) -> None:
    publish_many(engine, ["j-1"], destination="orders", clock=clock)
    spoil_the_stored_context(engine)
    with Relay(db_url, webhook(server.url), clock=clock) as relay:
        assert relay.dispatch_once() == [("j-1", "sent")]
    (span,) = sent(spans)
    assert (span.parent, linked(span)) == (None, [])
    assert [r.headers["traceparent"] for r in server.received] == ["junk"]


@sqlite_only
def test_unconfigured_the_relay_reads_no_context_and_makes_no_span(
    db_url: str,
    engine: sa.Engine,
    server: ScriptedServer,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    touched = refuse_tracing(monkeypatch)
    publish_many(engine, ["u-1"], destination="orders", clock=clock)
    spoil_the_stored_context(engine)
    assert not tracing.configured()
    with Relay(db_url, webhook(server.url), clock=clock) as relay:
        assert relay.dispatch_once() == [("u-1", "sent")]
    assert touched == []
    assert [r.headers["traceparent"] for r in server.received] == ["junk"]
