"""The HTTP receiver's `process replies` spans (receiver.app, receiver.spans): one per POST,
linked to (or, with continue_traces, continuing) each message's creation context, with
the dedupe outcome of a single message or a batch's counts by outcome."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from support.receiver_helpers import SECRET, AppClient, signed, stored_receipts
from support.tracing import ids, linked, named, refuse_tracing, spans, traceparent

from receiver import ReceiptStore, create_app
from receiver.effects import record_effect
from receiver.rules import ReceiverRules

__all__ = ["spans"]  # the fixture, used by name

PROCESS = "process replies"
MESSAGING = {
    "messaging.system": "webhook",
    "messaging.operation.type": "process",
    "messaging.operation.name": "process",
    "messaging.destination.name": "replies",
}
CONTEXTS = [(0x0A1 + n, 0x0B1 + n) for n in range(4)]
"""Trace and span ids of the publishers' spans, one a message."""


def client(store: ReceiptStore, continue_traces: bool = False) -> AppClient:
    """A client of the reference receiver app on `store`."""
    app = create_app(store, [SECRET], effect=record_effect, continue_traces=continue_traces)
    return AppClient(app)


def post_one(app: AppClient, reply_id: str, body: bytes, context: str | None) -> int:
    """POST one signed message carrying `context` as its traceparent; the status."""
    headers = signed(reply_id, body)
    if context is not None:
        headers["traceparent"] = context
    return app.post("/replies", content=body, headers=headers).status_code


def processed(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    """The receiver's process spans, in the order they ended."""
    return named(spans.get_finished_spans(), PROCESS)


def test_each_message_is_a_span_linked_to_its_creation_with_its_outcome(
    store: ReceiptStore, spans: InMemorySpanExporter
) -> None:
    app = client(store)
    answers = [
        post_one(app, "r-1", b'{"n":1}', traceparent(*CONTEXTS[0])),
        post_one(app, "r-1", b'{"n":1}', traceparent(*CONTEXTS[1])),  # the same again
        post_one(app, "r-1", b'{"n":2}', traceparent(*CONTEXTS[2])),  # another body
    ]
    assert answers == [200, 200, 409]
    made = processed(spans)
    assert [dict(span.attributes or {}) for span in made] == [
        {**MESSAGING, "messaging.message.id": "r-1", "outbox.dedupe.outcome": outcome}
        for outcome in ("stored", "duplicate", "conflict")
    ]
    for span, context in zip(made, CONTEXTS[:3], strict=True):
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is None
        assert span.context.trace_id != context[0]
        assert linked(span) == [context]


def test_with_continue_traces_a_single_message_is_its_creations_child(
    store: ReceiptStore, spans: InMemorySpanExporter
) -> None:
    app = client(store, continue_traces=True)
    assert post_one(app, "r-1", b"{}", traceparent(*CONTEXTS[0])) == 200
    (span,) = processed(spans)
    assert ids(span.parent) == CONTEXTS[0]
    assert span.context.trace_id == CONTEXTS[0][0]
    assert linked(span) == []


@pytest.mark.parametrize("continue_traces", [False, True])
@pytest.mark.parametrize("context", [None, "junk", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_a_message_without_a_readable_context_is_stored_in_a_trace_of_its_own(
    db_url: str,
    store: ReceiptStore,
    spans: InMemorySpanExporter,
    context: str | None,
    continue_traces: bool,
) -> None:
    assert post_one(client(store, continue_traces), "r-1", b"{}", context) == 200
    (span,) = processed(spans)
    assert (span.parent, linked(span)) == (None, [])
    assert span.attributes["outbox.dedupe.outcome"] == "stored"  # type: ignore[index]
    assert stored_receipts(db_url) == {"r-1": b"{}"}


def post_batch(app: AppClient, *items: dict[str, Any]) -> list[str]:
    """POST a signed batch of `items`; each item's status."""
    body = json.dumps({"replies": list(items)}).encode()
    response = app.post("/replies/batch", content=body, headers=signed("batch:1-9-9", body))
    assert response.status_code == 200, response.text
    return [result["status"] for result in response.json()["results"]]


def item(reply_id: str, body: str, context: tuple[int, int] | None = None) -> dict[str, Any]:
    """A batch item, with its creation context among its headers when given."""
    made: dict[str, Any] = {"reply_id": reply_id, "body": body}
    if context is not None:
        made["headers"] = {"traceparent": traceparent(*context), "x-tenant": "acme"}
    return made


@pytest.mark.parametrize("continue_traces", [False, True])
def test_a_batch_is_one_span_linked_to_each_items_creation_with_counts(
    store: ReceiptStore, spans: InMemorySpanExporter, continue_traces: bool
) -> None:
    store.accept("dup", b'{"n":1}', record_effect)
    store.accept("taken", b'{"n":1}', record_effect)
    statuses = post_batch(
        client(store, continue_traces),
        item("new", '{"n":1}', CONTEXTS[0]),
        item("dup", '{"n":1}', CONTEXTS[1]),
        item("plain", '{"n":1}'),
        item("taken", '{"n":2}', CONTEXTS[2]),
        item("bad", "{NaN}", CONTEXTS[3]),
    )
    assert statuses == ["stored", "duplicate", "stored", "conflict", "invalid"]
    (span,) = processed(spans)
    assert span.kind is SpanKind.CONSUMER
    # A batch carries many traces: never one's child. The invalid item is not read.
    assert span.parent is None
    assert linked(span) == CONTEXTS[:3]
    assert dict(span.attributes or {}) == {
        **MESSAGING,
        "messaging.batch.message_count": 5,
        "outbox.dedupe.stored": 2,
        "outbox.dedupe.duplicate": 1,
        "outbox.dedupe.conflict": 1,
        "outbox.dedupe.invalid": 1,
    }


def test_a_batch_of_one_names_its_message(store: ReceiptStore, spans: InMemorySpanExporter) -> None:
    assert post_batch(client(store), item("one", "{}", CONTEXTS[0])) == ["stored"]
    (span,) = processed(spans)
    assert (span.parent, linked(span)) == (None, [CONTEXTS[0]])
    assert dict(span.attributes or {}) == {
        **MESSAGING,
        "messaging.message.id": "one",
        "outbox.dedupe.outcome": "stored",
    }


def test_with_continue_traces_a_batch_of_one_is_its_creations_child(
    store: ReceiptStore, spans: InMemorySpanExporter
) -> None:
    # A relay in batch mode sends a trickle as batches of one: they continue as singles do.
    assert post_batch(client(store, True), item("one", "{}", CONTEXTS[0])) == ["stored"]
    (span,) = processed(spans)
    assert ids(span.parent) == CONTEXTS[0]
    assert span.context.trace_id == CONTEXTS[0][0]
    assert linked(span) == []
    assert span.attributes["messaging.message.id"] == "one"  # type: ignore[index]


def test_with_continue_traces_a_batch_with_one_valid_item_of_two_is_linked(
    store: ReceiptStore, spans: InMemorySpanExporter
) -> None:
    batch = [item("one", "{}", CONTEXTS[0]), item("bad", "{NaN}", CONTEXTS[1])]
    assert post_batch(client(store, True), *batch) == ["stored", "invalid"]
    (span,) = processed(spans)
    assert (span.parent, linked(span)) == (None, [CONTEXTS[0]])


def test_a_batch_span_starts_when_the_request_is_taken_not_once_its_items_are_read(
    store: ReceiptStore, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    reading: list[int] = []
    read_batch = ReceiverRules.read_batch

    def timed(self: ReceiverRules, headers: Mapping[str, str], body: bytes) -> object:
        reading.append(time.time_ns())
        return read_batch(self, headers, body)

    monkeypatch.setattr(ReceiverRules, "read_batch", timed)
    assert post_batch(client(store, True), item("one", "{}", CONTEXTS[0])) == ["stored"]
    (span,) = processed(spans)
    assert span.start_time is not None
    assert span.start_time <= reading[0]


def test_unconfigured_the_receiver_reads_no_context(
    db_url: str, store: ReceiptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    touched = refuse_tracing(monkeypatch)
    app = client(store, continue_traces=True)
    assert post_one(app, "r-1", b"{}", "junk") == 200
    assert post_batch(app, item("r-2", "{}", CONTEXTS[0])) == ["stored"]
    assert touched == []
    assert sorted(stored_receipts(db_url)) == ["r-1", "r-2"]


def test_a_refused_batch_is_a_failed_span(store: ReceiptStore, spans: InMemorySpanExporter) -> None:
    body = json.dumps({"replies": [item("r-1", "{}", CONTEXTS[0])]}).encode()
    headers = signed("batch:1-1-1", body)
    headers["webhook-signature"] = "v1,bm90IGEgc2lnbmF0dXJl"
    assert client(store).post("/replies/batch", content=body, headers=headers).status_code == 401
    (span,) = processed(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "401"  # type: ignore[index]
    assert "signature" in (span.status.description or "")
