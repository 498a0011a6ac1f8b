"""A stand-in for an OpenTelemetry collector: OTLP/HTTP traces on a loopback port.

It takes what an OTLP/HTTP span exporter posts (`POST /v1/traces`, a protobuf
ExportTraceServiceRequest, plain or gzip- or deflate-compressed), decodes it with
opentelemetry-proto and keeps each span with the service that sent it. A request it
cannot take (another path, content type or encoding, a body that does not decode) is
answered with an error and noted in `refused`, so that a test sees why spans are missing.
Tests wait for the spans they expect with wait_for(), which wakes at each export.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

PROTOBUF = "application/x-protobuf"
TRACES_PATH = "/v1/traces"
DECOMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "": lambda body: body,
    "identity": lambda body: body,
    "gzip": gzip.decompress,
    "deflate": zlib.decompress,
}
"""The Content-Encodings an OTLP/HTTP exporter may use (none, gzip, deflate)."""
SHUTDOWN_POLL = 0.05
"""Seconds between the server's looks for close(): its wait when the test ends."""


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span as the collector decoded it (ids in lowercase hex)."""

    service: str
    """The `service.name` attribute of the resource that exported it."""
    scope: str
    """The instrumentation scope's name (`outbox` for the toolkit's own spans)."""
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    """`internal`, `server`, `client`, `producer`, `consumer` (or `unspecified`)."""
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]
    """(trace_id, span_id) of each link."""


class OtlpCollector:
    """The collector stand-in, serving in a thread from construction until close()."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.refused: list[str] = []
        """Why each refused request was refused."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL,), daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The base URL for OTEL_EXPORTER_OTLP_ENDPOINT (the exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in the order they came."""
        with self._changed:
            return list(self._spans)

    def wait_for(
        self, condition: Callable[[Sequence[ReceivedSpan]], bool], timeout: float, what: str
    ) -> list[ReceivedSpan]:
        """The spans received, once `condition` holds for them; AssertionError after
        `timeout` seconds, naming `what` and showing what did arrive."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out after {timeout}s waiting for {what}; received: "
                        f"{[(s.service, s.name) for s in self._spans]}, refused: {self.refused}"
                    )
                self._changed.wait(left)
            return list(self._spans)

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _accept(self, request: ExportTraceServiceRequest) -> None:
        """Keep every span of a decoded export and wake the waiters."""
        received = list(_spans_of(request))
        with self._changed:
            self._spans.extend(received)
            self._changed.notify_all()

    def _refuse(self, why: str) -> None:
        with self._changed:
            self.refused.append(why)
            self._changed.notify_all()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = self.headers.get("Content-Length")
                if length is None:  # chunked: not read here, and not to be taken as empty
                    answer: tuple[int, str] | None = (411, "no Content-Length")
                else:
                    answer = self._take(self.rfile.read(int(length)))
                if answer is None:
                    self._answer(200, ExportTraceServiceResponse().SerializeToString(), PROTOBUF)
                else:
                    collector._refuse(f"{self.path}: {answer[1]}")
                    self._answer(answer[0], answer[1].encode(), "text/plain")

            def _take(self, body: bytes) -> tuple[int, str] | None:
                """None once the export is kept, else the status and reason to answer."""
                if self.path != TRACES_PATH:
                    return 404, f"not {TRACES_PATH}"
                content_type = self.headers.get("Content-Type", "")
                if content_type.split(";")[0].strip() != PROTOBUF:
                    return 415, f"content type {content_type!r}, not {PROTOBUF}"
                encoding = self.headers.get("Content-Encoding", "").strip().lower()
                if encoding not in DECOMPRESS:
                    return 415, f"content encoding {encoding!r}"
                try:
                    request = ExportTraceServiceRequest.FromString(DECOMPRESS[encoding](body))
                except (DecodeError, OSError, zlib.error) as exc:
                    return 400, f"undecodable export: {exc}"
                collector._accept(request)
                return None

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the test reads `refused` rather than a log."""

        return Handler


@contextmanager
def otlp_collector() -> Iterator[OtlpCollector]:
    """A collector stand-in, closed on the way out."""
    collector = OtlpCollector()
    try:
        yield collector
    finally:
        collector.close()


def _spans_of(request: ExportTraceServiceRequest) -> Iterator[ReceivedSpan]:
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield ReceivedSpan(
                    service=service,
                    scope=scope_spans.scope.name,
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex() or None,
                    name=span.name,
                    kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_").lower(),
                    attributes=_attributes(span.attributes),
                    links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                )


def _attributes(pairs: Sequence[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    """An attribute's value as Python: str, bool, int, float, bytes, list or dict."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind)
