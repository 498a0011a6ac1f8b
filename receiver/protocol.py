"""uvicorn's httptools protocol with a header size limit and a deadline per request.

uvicorn parses with httptools when it is installed (the ``fast`` extra), and then
has no header size limit at all (httptools accumulates a header value until it
ends) and no deadline for reading a request: a client can send a huge header, or
send a request slowly, or declare a Content-Length it never sends, and hold
memory and a connection for as long as it likes. This subclass adds both:

* once more than `header_limit` bytes of a request have arrived without its
  header block ending, it answers 431 and closes, so at most the limit plus one
  socket read is ever buffered for headers;
* a request must arrive whole (headers and body) within `request_timeout`
  seconds of its first byte, or of the connection's start for the first
  request, so a connection that sends nothing is closed too. Past it the client
  gets 408 (unless the app has already begun its answer) and the connection is
  closed; the app sees the client as gone. The timer is per connection, so a
  slow client never delays the others.

Without httptools the receiver runs uvicorn's h11 protocol, whose
``h11_max_incomplete_event_size`` is the header limit (`http_settings`); the
deadline then covers only what uvicorn's keep-alive timeout does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_HEADER_LIMIT = 65_536
DEFAULT_REQUEST_TIMEOUT = 10.0


def _plain(status: bytes, message: str) -> bytes:
    body = message.encode("ascii")
    return b"".join(
        [
            b"HTTP/1.1 " + status + b"\r\n",
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class GuardedHttpTools(HttpToolsProtocol):
    """HttpToolsProtocol that refuses oversized headers and cuts off slow requests."""

    header_limit = DEFAULT_HEADER_LIMIT
    request_timeout = DEFAULT_REQUEST_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Set up the protocol as uvicorn does, plus the per-request guard state."""
        super().__init__(*args, **kwargs)
        self._in_headers = True  # the next bytes belong to a header block
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the first request's deadline with the connection: silence counts too."""
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the deadline with the connection."""
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser, refusing a header block that grows past the limit."""
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._in_headers and self._header_bytes > self.header_limit and self.parser:
            self._refuse(b"431 Request Header Fields Too Large", "request headers too large")

    def on_message_begin(self) -> None:
        """A request starts: its deadline runs from here unless the connection's still does."""
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        """The header block ended within the limit."""
        self._in_headers = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """The whole request arrived in time: the next bytes start a new one."""
        self._disarm()
        self._in_headers = True
        self._header_bytes = 0
        super().on_message_complete()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.request_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        self._refuse(b"408 Request Timeout", "request not received in time")

    def _refuse(self, status: bytes, message: str) -> None:
        self._disarm()
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # a pipelined answer is being written: no room for ours
            return
        if cycle is not None and not cycle.response_complete:
            # The app must not write after the refusal: to it, the client has left.
            cycle.disconnected = True
            cycle.message_event.set()
        if not self.transport.is_closing():
            self.transport.write(_plain(status, message))
            self.transport.close()


def guarded_httptools(header_limit: int, request_timeout: float) -> type[GuardedHttpTools]:
    """A GuardedHttpTools class with these limits, for uvicorn.Config(http=...)."""
    return type(
        "GuardedHttpTools",
        (GuardedHttpTools,),
        {"header_limit": header_limit, "request_timeout": request_timeout},
    )


def http_settings(header_limit: int, request_timeout: float) -> dict[str, Any]:
    """uvicorn.Config arguments enforcing these limits with the best parser installed."""
    try:
        import httptools  # noqa: F401 - only whether it is there
    except ImportError:
        return {"http": "h11", "h11_max_incomplete_event_size": header_limit}
    return {"http": guarded_httptools(header_limit, request_timeout)}
