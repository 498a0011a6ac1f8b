"""Guards that refuse a request before the rules see it, from its raw ASGI headers.

A header that a check reads once must arrive once: with `webhook-signature` or
`webhook-id` twice, one layer would read the first copy and another the last, and
`Content-Type` twice is ambiguous the same way. Such a request is refused with 400
on every endpoint.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

SINGLE_HEADERS = frozenset(
    {b"webhook-id", b"webhook-timestamp", b"webhook-signature", b"content-type"}
)


class SingleHeaders:
    """ASGI middleware: 400 for a request that repeats one of SINGLE_HEADERS."""

    def __init__(self, app: ASGIApp) -> None:
        """Wrap `app`."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, unless it repeats a header read once."""
        if scope["type"] == "http":
            repeated = _repeated(scope["headers"])
            if repeated is not None:
                await send_json(send, 400, {"error": f"header {repeated} appears more than once"})
                return
        await self.app(scope, receive, send)


def _repeated(headers: list[tuple[bytes, bytes]]) -> str | None:
    seen: set[bytes] = set()
    for name, _ in headers:
        key = name.lower()
        if key in SINGLE_HEADERS:
            if key in seen:
                return key.decode()
            seen.add(key)
    return None


async def send_json(
    send: Send, status: int, document: dict[str, str], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """Answer an ASGI request with a JSON document, before or instead of the app."""
    body = json.dumps(document).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
