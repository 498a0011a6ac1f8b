"""A cap on the request body bytes the receiver holds at once, across all requests.

Each body is read whole before its signature can be checked, so `max_body`
bounds one request but not their sum: many clients sending large unsigned
bodies at once would each be buffered. `BodyBudget` reserves, before the body
is read, the bytes a request may take (its Content-Length, or `max_body` when
the length is not declared); a request that does not fit gets 503 with
Retry-After (which the relay retries) without a byte of its body being read.
The reservation is returned when the request ends, however it ends.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from receiver.guards import send_json
from receiver.rules import RETRY_AFTER_SECONDS

DEFAULT_BODY_BUDGET = 67_108_864


class BodyBudget:
    """ASGI middleware: 503 with Retry-After for a body the budget cannot hold now."""

    def __init__(self, app: ASGIApp, budget: int, max_body: int) -> None:
        """Wrap `app`; `budget` bytes are shared, each request takes at most `max_body`."""
        if budget < max_body:
            raise ValueError(f"body budget {budget} is smaller than max_body {max_body}")
        self.app = app
        self.budget = budget
        self.max_body = max_body
        self.in_use = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on with its bytes reserved, or refuse it if they do not fit."""
        size = self._wanted(scope) if scope["type"] == "http" else 0
        if size == 0:
            await self.app(scope, receive, send)
            return
        if self.in_use + size > self.budget:
            await _unavailable(send)
            return
        # Single-threaded event loop: nothing runs between the check and the reservation.
        self.in_use += size
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_use -= size

    def _wanted(self, scope: Scope) -> int:
        """Bytes this request's body may occupy: 0 when the app refuses it unread."""
        declared: bytes | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"transfer-encoding":
                chunked = True
        if declared is not None:
            if not declared.isdigit():
                return 0  # the app answers 400 before reading
            length = int(declared)
            return 0 if length > self.max_body else length  # over max_body: 413 unread
        return self.max_body if chunked else 0


async def _unavailable(send: Send) -> None:
    retry = (b"retry-after", str(RETRY_AFTER_SECONDS).encode())
    # The body stays unread: closing spares reading it only to throw it away.
    close = (b"connection", b"close")
    await send_json(send, 503, {"error": "receiver busy, retry"}, (retry, close))
