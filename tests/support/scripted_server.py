"""A real HTTP server on loopback whose answers a test scripts, per reply_id."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass
class Answer:
    """One scripted response: status, headers, and an optional stall or gate before answering."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    stall: float = 0.0
    body: bytes = b"{}"
    gate: threading.Event | None = None
    """When given, the answer waits until the test sets this event (GATE_LIMIT at most):
    a request held for as long as the test needs, however slow the machine. A test that
    holds one sets the event in a `finally`, or the server's shutdown waits for the limit."""


GATE_LIMIT = 300.0
"""The longest a gated answer waits for its event."""


@dataclass
class Received:
    """One request as the server saw it."""

    path: str
    webhook_id: str
    body: bytes
    headers: dict[str, str]


class ScriptedServer:
    """uvicorn in a thread, answering from per-id scripts (default 200), recording requests."""

    def __init__(self, extra_headers: dict[str, str] | None = None) -> None:
        self.scripts: dict[str, deque[Answer]] = defaultdict(deque)
        self.received: list[Received] = []
        self.extra_headers = extra_headers or {}
        self.default = Answer()
        self.health_gate: threading.Event | None = None
        """When set to an event, /healthz answers only once that event is set."""
        self.health_arrivals = 0
        self._lock = threading.Lock()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        app = Starlette(
            routes=[
                Route("/replies", self._post, methods=["POST"]),
                Route("/healthz", self._health, methods=["GET"]),
            ]
        )
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="error", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        """The endpoint the relay posts to."""
        return f"http://127.0.0.1:{self.port}/replies"

    def script(self, webhook_id: str, *answers: Answer) -> None:
        """Queue answers for requests carrying this webhook-id (then 200s)."""
        with self._lock:
            self.scripts[webhook_id].extend(answers)

    def ids(self) -> list[str]:
        """The webhook-ids received, in arrival order."""
        with self._lock:
            return [r.webhook_id for r in self.received]

    async def _post(self, request: Request) -> Response:
        body = await request.body()
        webhook_id = request.headers.get("webhook-id", "")
        with self._lock:
            self.received.append(
                Received(request.url.path, webhook_id, body, dict(request.headers))
            )
            script = self.scripts.get(webhook_id)
            answer = script.popleft() if script else self.default
        if answer.stall:
            await asyncio.sleep(answer.stall)  # the peer is slow; the relay must not wait for it
        if answer.gate is not None:
            await asyncio.to_thread(answer.gate.wait, GATE_LIMIT)
        return Response(answer.body, answer.status, {**self.extra_headers, **answer.headers})

    async def _health(self, request: Request) -> Response:
        with self._lock:
            self.health_arrivals += 1
        if self.health_gate is not None:
            await asyncio.to_thread(self.health_gate.wait, 10)
        return Response(b"{}", 200, self.extra_headers)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        pause = threading.Event()
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("scripted server did not start")
            pause.wait(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
