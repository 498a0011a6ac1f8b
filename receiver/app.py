"""The thin ASGI shell around receiver.rules: read the body within its limit, answer.

The decisions (and their order) are documented in ``receiver.rules``. This
module only streams the body with a size cap (so an oversized or chunked body
is refused before it is buffered), runs the blocking store calls in the
thread pool (single messages that arrive together in one group commit), and
adds the retention header to every response. It also answers GET /healthz
(liveness, and the retention a relay checks at start), GET /readyz (503 while
the database does not answer) and GET /metrics (receiver.metrics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox import tracing
from outbox.group_commit import GroupCommit
from outbox.observability.probe import Probe
from outbox.observability.server import METRICS_CONTENT_TYPE
from outbox.signing import DEFAULT_TOLERANCE, parse_secret
from receiver.budget import DEFAULT_BODY_BUDGET, BodyBudget
from receiver.effects import Effect
from receiver.guards import SingleHeaders
from receiver.metrics import CountingStore, CountRequests, ReceiverMetrics
from receiver.rules import MAX_BATCH_ITEMS, Answer, ReceiverRules, Store, error, receiver_rules
from receiver.spans import HTTP_SYSTEM, creation_context, processing, record_outcomes

SOURCE = "replies"
"""`messaging.destination.name` of the HTTP receiver's process spans."""

DEFAULT_MAX_BODY = 1_048_576
READY_DEADLINE = 1.0
"""Seconds /readyz waits for the database before it answers 503."""


class _TooLarge(Exception):
    pass


async def _read_limited(request: Request, limit: int) -> bytes:
    """The body, refusing (before buffering it all) anything over `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ValueError("malformed Content-Length")
        if int(declared) > limit:
            raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    if declared is not None and int(declared) != size:
        raise ValueError("body length differs from Content-Length")
    return b"".join(chunks)


def _respond(answer: Answer) -> Response:
    if isinstance(answer.document, bytes):
        return Response(
            answer.document,
            status_code=answer.status,
            headers=answer.headers,
            media_type=JSONResponse.media_type,
        )
    return JSONResponse(answer.document, status_code=answer.status, headers=answer.headers)


class _RetentionHeader:
    """Adds the retention header to every response, including the framework's own 404/405."""

    def __init__(self, app: ASGIApp, headers: dict[str, str]) -> None:
        self.app = app
        self.raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.raw]
            await send(message)

        await self.app(scope, receive, send_with_header)


def build_app(
    rules: ReceiverRules,
    metrics: ReceiverMetrics | None = None,
    database: Callable[[], object | None] | None = None,
    body_budget: int | None = None,
    continue_traces: bool = False,
) -> Starlette:
    """A Starlette app answering with `rules`, counting into `metrics`; `database` (a
    Probe) says whether the database answers, for /readyz (None: always ready);
    `body_budget` caps the body bytes held at once (None: 64 MiB, or max_body if larger);
    `continue_traces`: a single message's process span continues the publisher's trace
    rather than linking to it (receiver.spans)."""
    metrics = metrics or ReceiverMetrics()
    if body_budget is None:
        body_budget = max(DEFAULT_BODY_BUDGET, rules.max_body)
    if body_budget < rules.max_body:
        # Checked here: Starlette builds its middleware only at the first request.
        raise ValueError(f"body_budget {body_budget} is smaller than max_body {rules.max_body}")

    async def read_body(request: Request) -> bytes | Answer:
        try:
            return await _read_limited(request, rules.max_body)
        except _TooLarge:
            return error(413, f"body larger than {rules.max_body} bytes")
        except ValueError as exc:
            return error(400, str(exc))
        except ClientDisconnect:
            return error(400, "client disconnected")  # nobody will read it

    # Single messages that arrive while a transaction runs are stored together in the
    # next one (up to a batch's limit), in the thread pool: the store blocks.
    async def store_together(items: list[tuple[str, bytes]]) -> list[Answer]:
        return await run_in_threadpool(rules.store_messages, items)

    group = GroupCommit(store_together, max_batch=MAX_BATCH_ITEMS)

    async def post_message(request: Request) -> Response:
        body = await read_body(request)
        if isinstance(body, Answer):
            return _respond(body)
        # The checks need no I/O: they run here; only storing goes to a thread.
        checked = rules.check_message(request.headers, body)
        if isinstance(checked, Answer):
            return _respond(checked)
        if not tracing.configured():
            return _respond(await group.submit(checked))
        context = creation_context(request.headers)
        with processing(
            HTTP_SYSTEM, SOURCE, [checked[0]], [context], continue_traces=continue_traces
        ) as span:
            answer = await group.submit(checked)
            record_outcomes(span, [_outcome(answer)])
            _refused(span, answer)
        return _respond(answer)

    async def post_batch(request: Request) -> Response:
        body = await read_body(request)
        if isinstance(body, Answer):
            return _respond(body)
        if not tracing.configured():
            return _respond(await run_in_threadpool(rules.post_batch, request.headers, body))
        # The span needs the items' contexts to start (a batch of one may continue its
        # message's trace), so it starts once they are read, dated from the request.
        began = time.time_ns()
        read = await run_in_threadpool(rules.read_batch, request.headers, body)
        if isinstance(read, Answer):
            ids, contexts, single = [], [], False
        else:
            ids, contexts, single = read.reply_ids(), read.contexts(), len(read.items) == 1
        with processing(
            HTTP_SYSTEM,
            SOURCE,
            ids,
            contexts,
            continue_traces=continue_traces and single,
            start_time=began,
        ) as span:
            if isinstance(read, Answer):
                answer = read
            else:
                answer = await run_in_threadpool(rules.store_batch, read, span)
            _refused(span, answer)
        return _respond(answer)

    async def get_receipt(request: Request) -> Response:
        reply_id = request.path_params["reply_id"]
        answer = await run_in_threadpool(rules.get_reply, reply_id, request.headers)
        return _respond(answer)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        if database is None:
            return JSONResponse({"ok": True})  # a store that cannot be asked: nothing to check
        # The probe waits up to its deadline on a thread, never on the event loop.
        answered = await run_in_threadpool(database) is not None
        return JSONResponse(
            {"ok": answered, "database": answered}, status_code=200 if answered else 503
        )

    async def metrics_page(request: Request) -> Response:
        # Rendering reads the database gauge through the probe: also off the event loop.
        body = await run_in_threadpool(metrics.render)
        return Response(body, headers={"content-type": METRICS_CONTENT_TYPE})

    app = Starlette(
        routes=[
            Route("/replies", post_message, methods=["POST"]),
            Route("/replies/batch", post_batch, methods=["POST"]),
            Route("/replies/{reply_id:path}", get_receipt, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics_page, methods=["GET"]),
        ]
    )
    app.add_middleware(SingleHeaders)
    app.add_middleware(BodyBudget, budget=body_budget, max_body=rules.max_body)
    app.add_middleware(_RetentionHeader, headers=rules.retention_headers())
    app.add_middleware(CountRequests, metrics=metrics)
    return app


def _refused(span: tracing.Span, answer: Answer) -> None:
    """Mark the span failed when the request was refused or could not be stored (a 409 is
    a dedupe outcome, a conflict, not a failure of the receiver)."""
    if answer.status >= 400 and answer.status != 409:
        document = answer.document
        reason = document.get("error") if isinstance(document, dict) else None
        span.fail(str(answer.status), str(reason or f"HTTP {answer.status}"))


def _outcome(answer: Answer) -> str:
    """A single message's dedupe outcome, as its answer says it."""
    if answer.status == 200:
        document = answer.document
        duplicate = isinstance(document, dict) and document.get("duplicate") is True
        return "duplicate" if duplicate else "stored"
    return "conflict" if answer.status == 409 else "retry"


def create_app(
    store: Store,
    secrets: Iterable[str | bytes],
    tolerance: float = DEFAULT_TOLERANCE,
    max_body: int = DEFAULT_MAX_BODY,
    effect: Effect | None = None,
    *,
    wall_clock: Callable[[], float] | None = None,
    metrics: ReceiverMetrics | None = None,
    body_budget: int | None = None,
    continue_traces: bool = False,
) -> Starlette:
    """The receiver app: POST /replies, GET /replies/{reply_id}, /healthz, /readyz, /metrics.

    `store` is a ReceiptStore (or anything with its accept_many/lookup/retention, and
    ping for /readyz);
    `effect` runs once per first receipt (None: none; the reference app passes
    receiver.effects.record_effect); `wall_clock` replaces time.time for
    signature timestamps only, so fixed test vectors can be checked; `metrics`
    (default: new ones) is what /metrics shows; `body_budget` caps the body bytes
    buffered at once across requests (None: 64 MiB, or max_body if larger);
    `continue_traces`: a single message's process span is the child of its creation
    context rather than linked to it (receiver.spans).
    """
    if isinstance(secrets, str | bytes):
        raise TypeError("secrets must be a list of secrets, not one secret")
    metrics = metrics or ReceiverMetrics()
    # A store of the caller's own may have no ping: then readiness does not ask the database.
    ping = getattr(store, "ping", None)
    database = None if ping is None else Probe(ping, deadline=READY_DEADLINE)
    if database is not None:
        metrics.watch(database)
    rules = receiver_rules(
        CountingStore(store, metrics),
        [parse_secret(secret) for secret in secrets],
        tolerance=tolerance,
        max_body=max_body,
        effect=effect,
        wall_clock=wall_clock,
    )
    return build_app(rules, metrics, database, body_budget, continue_traces)
