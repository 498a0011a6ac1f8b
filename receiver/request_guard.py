"""The header limit and the request deadline that the receiver adds to uvicorn's protocols.

uvicorn parses with httptools when it is installed (the ``fast`` extra) and with
h11 otherwise. Neither protocol has a deadline for reading a request, and
httptools has no header size limit at all (it accumulates a header value until
it ends): a client could send a huge header, or send a request slowly, or
declare a Content-Length it never sends, and hold memory and a connection for as
long as it likes. `RequestGuard` adds the same two limits to either protocol
(receiver.protocol_httptools, receiver.protocol_h11):

* once more than `header_limit` bytes of a request have arrived without its
  header block ending, it answers 431 and closes, so at most the limit plus one
  socket read is ever buffered for headers;
* a request must arrive whole (headers and body) within `request_timeout`
  seconds of its first byte, or of the connection's start for the first
  request, so a connection that sends nothing is closed too. Past it the client
  gets 408 (unless the app has already begun its answer) and the connection is
  closed; the app sees the client as gone. The timer is per connection, so a
  slow client never delays the others.
"""

from __future__ import annotations

import asyncio
from typing import Any

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


class RequestGuard(asyncio.Protocol):
    """The header limit and the request deadline, mixed in before one of uvicorn's protocols.

    The protocol calls `_request_begins` when a request's first byte arrives and
    `_request_received` when its last one has, and `_refuse_headers` once its
    header block has grown past `header_limit`.
    """

    header_limit = DEFAULT_HEADER_LIMIT
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT
    """None: no deadline, the header limit alone."""
    # Set by the uvicorn protocol this is mixed into; `cycle` is its current request's.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Start the first request's deadline with the connection: silence counts too."""
        super().connection_made(transport)
        self._request_begins()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the deadline with the connection."""
        self._disarm()
        super().connection_lost(exc)

    @property
    def awaiting_request_end(self) -> bool:
        """Whether a request's deadline (or the connection's first) is running."""
        return self._deadline is not None

    def _request_begins(self) -> None:
        """A request's deadline runs from here, unless the connection's still does."""
        if self._deadline is None and self.request_timeout is not None:
            self._deadline = self.loop.call_later(self.request_timeout, self._expire)

    def _request_received(self) -> None:
        """The whole request arrived in time."""
        self._disarm()

    def _refuse_headers(self) -> None:
        """The header block grew past the limit: 431, and the connection closes."""
        self._refuse(b"431 Request Header Fields Too Large", "request headers too large")

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
