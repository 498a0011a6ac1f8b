"""uvicorn's httptools protocol under the receiver's RequestGuard (the ``fast`` extra).

httptools reports each request's begin, header end and completion as callbacks;
the header bytes are counted here, since httptools itself has no limit.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from receiver.request_guard import RequestGuard


class GuardedHttpTools(RequestGuard, HttpToolsProtocol):
    """HttpToolsProtocol that refuses oversized headers and cuts off slow requests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Set up the protocol as uvicorn does, plus the header count."""
        super().__init__(*args, **kwargs)
        self._in_headers = True  # the next bytes belong to a header block
        self._header_bytes = 0

    def data_received(self, data: bytes) -> None:
        """Feed the parser, refusing a header block that grows past the limit."""
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # No parser: the connection was lost while its bytes were read.
        if self._in_headers and self._header_bytes > self.header_limit and self.parser:
            self._refuse_headers()

    def on_message_begin(self) -> None:
        """A request starts."""
        super().on_message_begin()
        self._request_begins()

    def on_headers_complete(self) -> None:
        """The header block ended within the limit."""
        self._in_headers = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """The whole request arrived: the next bytes start a new one."""
        self._request_received()
        self._in_headers = True
        self._header_bytes = 0
        super().on_message_complete()
