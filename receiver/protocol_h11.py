"""uvicorn's h11 protocol under the receiver's RequestGuard: the receiver without httptools.

h11 already buffers at most `max_incomplete_event_size` bytes of an unfinished
request head; given the header limit, its refusal becomes the guard's 431 (uvicorn
would answer 400). Requests begin and end where h11's events say so: its
connection here reports them as uvicorn reads them.
"""

from __future__ import annotations

from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from receiver.request_guard import RequestGuard


class _ReportingConnection(h11.Connection):
    """An h11 server connection that tells the guard where requests begin and end."""

    def __init__(self, guard: GuardedH11, header_limit: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=header_limit)
        self.guard = guard
        self.headers_too_large = False

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """h11's next event, reported to the guard."""
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            # h11's hint for an unfinished event over max_incomplete_event_size.
            self.headers_too_large = exc.error_status_hint == 431
            raise
        if event is h11.NEED_DATA and not self.guard.awaiting_request_end:
            # Waiting for more of a request: one has begun if its body is due or any of
            # its head is buffered. (After a request, h11 waits in DONE for our answer.)
            state = self.their_state
            if state is h11.SEND_BODY or (state is h11.IDLE and self.trailing_data[0]):
                self.guard._request_begins()
        elif type(event) is h11.EndOfMessage:
            self.guard._request_received()
        return event


class GuardedH11(RequestGuard, H11Protocol):
    """H11Protocol that refuses oversized headers with 431 and cuts off slow requests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Set up the protocol as uvicorn does, on a connection that reports to the guard."""
        super().__init__(*args, **kwargs)
        self._connection = _ReportingConnection(self, self.header_limit)
        self.conn = self._connection

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a malformed request; 431 for a header block over the limit."""
        if self._connection.headers_too_large:
            self._refuse_headers()
        else:
            super().send_400_response(msg)
