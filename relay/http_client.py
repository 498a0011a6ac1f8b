"""The relay's HTTP client: one keep-alive aiohttp session per destination.

aiohttp costs about a fifth of the CPU per request of httpx's async client on
this workload (measured with 4 requests in flight: 81-111 us against 521-546
us), which decides how many single-mode deliveries one relay can make.

Every request is bounded as a whole by one deadline (connect, send, and the
whole answer), because per-operation timeouts let a trickling peer hold an
attempt for ever. The answer is read completely, up to MAX_ANSWER_BYTES.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from outbox.redaction import redact_urls
from relay.errors import TransportError

if TYPE_CHECKING:
    import aiohttp

MAX_ANSWER_BYTES = 8 * 1024 * 1024


_aiohttp_module: Any = None


def _aiohttp() -> Any:
    """aiohttp, imported at the first request: every command imports the relay's settings
    to check a config file, and only a relay sending HTTP needs aiohttp (a tenth of a second
    and more of start-up for each of the others)."""
    global _aiohttp_module
    if _aiohttp_module is None:
        _aiohttp_module = importlib.import_module("aiohttp")
    return _aiohttp_module


@dataclass(frozen=True)
class Response:
    """A whole HTTP answer: status, headers (case-insensitive) and body bytes."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def text(self) -> str:
        """The body as text, undecodable bytes replaced."""
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON (ValueError when it is not, or nests too deep to parse)."""
        try:
            return json.loads(self.body)
        except RecursionError as exc:
            raise ValueError("answer nests too deep to parse") from exc


class HttpClient:
    """Pooled HTTP/1.1 connections to one destination, at most `connections` at once."""

    def __init__(self, connections: int) -> None:
        """Nothing opens until the first request, which must run on the relay's loop."""
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None = None,
        seconds: float,
    ) -> Response:
        """Send one request and read its whole answer within `seconds` (else TimeoutError)."""
        session = self._session_on_this_loop()
        aiohttp = _aiohttp()
        try:
            async with (
                asyncio.timeout(seconds),
                session.request(
                    method, url, data=body, headers=dict(headers), allow_redirects=False
                ) as answer,
            ):
                return Response(answer.status, answer.headers, await _whole(answer))
        except aiohttp.ClientError as exc:
            raise TransportError(_describe(exc)) from exc

    async def close(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_on_this_loop(self) -> aiohttp.ClientSession:
        aiohttp = _aiohttp()
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections),
                # One deadline per request is enforced above; proxies and .netrc
                # credentials from the environment are not picked up silently.
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session


async def _whole(answer: aiohttp.ClientResponse) -> bytes:
    """The whole body, up to MAX_ANSWER_BYTES; TransportError beyond that."""
    too_large = TransportError(f"answer larger than {MAX_ANSWER_BYTES} bytes")
    if (answer.content_length or 0) > MAX_ANSWER_BYTES:
        raise too_large
    # content.read(n) returns what is buffered so far, not n bytes: an answer that
    # arrives in several segments must be read to its end.
    data = bytearray()
    async for chunk in answer.content.iter_any():
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            raise too_large
    return bytes(data)


def _describe(exc: aiohttp.ClientError) -> str:
    # aiohttp's errors may quote the request URL, and a destination URL may carry a token.
    detail = redact_urls(str(exc).strip())
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
