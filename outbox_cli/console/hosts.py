"""The names a console answers to, and the origin its forms must come from.

A console bound to loopback answers only requests that name it: a Host header of
its own address or a loopback name (any port: a tunnel forwards from its own).
Without that, a page whose name re-resolves to 127.0.0.1 (DNS rebinding) would be
same-origin with a console that asks no token. Off loopback the token is required
and guards it: the names operators reach it by are not known to it, and a rebinding
page holds neither the token nor the session cookie (which belongs to the console's
real name). A POST whose Origin header is present must come from the console's own
origin.
"""

from __future__ import annotations

import ipaddress
import re

from starlette.requests import Request

HOST_HEADER = re.compile(
    r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::(?P<port>[0-9]{1,5}))?"
)
"""A Host header as the console takes it: a name or IPv4 address, or an IPv6 address in
brackets, then at most a port. Anything looser let a parser see a loopback name in a
header that names another host (`127.0.0.1:1@evil.example`, `[::1]evil.example`)."""


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback name or address (only then may a token be absent)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> frozenset[str] | None:
    """The host names a console bound to `host` answers to (lower case), or None (any)
    off loopback, where the token guards it. Any port: a tunnel (ssh -L 9000:...) forwards
    from a port of its own, and a rebinding page is told apart by its name alone."""
    if not is_loopback(host):
        return None
    own = ipaddress.ip_address(host).compressed if ":" in host else host.lower()
    return frozenset({own, "localhost", "127.0.0.1", "::1"})


def host_name(header: str) -> str | None:
    """The name in a Host header (lower case; an IPv6 address without brackets, in its
    short form), or None when the header is not exactly a host and an optional port."""
    found = HOST_HEADER.fullmatch(header)
    if found is None or (found["port"] is not None and not 0 < int(found["port"]) <= 65_535):
        return None
    if found["ipv6"] is None:
        return found["name"].lower()
    try:
        return ipaddress.IPv6Address(found["ipv6"]).compressed
    except ValueError:
        return None


def foreign_origin(request: Request) -> bool:
    """Whether the request names an Origin other than the one it was addressed to."""
    origin = request.headers.get("origin")
    if origin is None:
        return False
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    return origin.lower() != own.lower()
