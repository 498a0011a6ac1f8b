"""The receiver's HTTP protocol: uvicorn's, with the request guard's header size limit and
deadline (receiver.request_guard) on the fastest parser installed.

The other limits (connections, keep-alive, the body budget) are uvicorn's
settings and ASGI middleware, the same for both parsers; which parser runs
changes only the CPU a request costs.
"""

from __future__ import annotations

from typing import Any

from receiver.request_guard import RequestGuard


def guarded(
    protocol: type[RequestGuard], header_limit: int, request_timeout: float | None
) -> type[RequestGuard]:
    """A subclass of a guarded `protocol` with these limits, for uvicorn.Config(http=...)."""
    return type(
        protocol.__name__,
        (protocol,),
        {"header_limit": header_limit, "request_timeout": request_timeout},
    )


def http_settings(header_limit: int, request_timeout: float | None) -> dict[str, Any]:
    """uvicorn.Config arguments enforcing these limits with the fastest parser installed.

    Whichever parser that is, the same requests are served and refused.
    """
    protocol: type[RequestGuard]
    try:
        from receiver.protocol_httptools import GuardedHttpTools as protocol
    except ModuleNotFoundError as exc:
        if exc.name != "httptools":
            raise
        from receiver.protocol_h11 import GuardedH11 as protocol
    return {"http": guarded(protocol, header_limit, request_timeout)}
