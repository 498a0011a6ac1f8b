"""The console's POSTed forms: size-limited, free of NUL bytes, and CSRF-checked.

Every POST must carry the CSRF token of the double-submit cookie in its form: a
cross-site form cannot read the cookie, and SameSite=Strict keeps the browser from
sending it along.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import parse_qsl

from starlette.exceptions import HTTPException
from starlette.requests import Request

CSRF_COOKIE = "outbox_console_csrf"
CSRF_FIELD = "csrf_token"
MAX_FORM_BYTES = 65_536


def has_nul(fields: Iterable[tuple[str, str]]) -> bool:
    """Whether a name or value of `fields` holds a NUL character."""
    return any("\x00" in name or "\x00" in value for name, value in fields)


async def form_body(request: Request) -> bytes:
    """The request's body, refused (413) as soon as it outgrows MAX_FORM_BYTES.

    Read chunk by chunk with the limit applied while reading: a body read whole before
    its check could hold any size in memory, and login takes one with no credential.
    """
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise HTTPException(413, "form too large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise HTTPException(413, "form too large")
    return bytes(body)


async def checked_form(request: Request) -> dict[str, str]:
    """The POSTed form's fields, after its CSRF token matched the cookie (else 403)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != (
        "application/x-www-form-urlencoded"
    ):
        raise HTTPException(415, "a form must be application/x-www-form-urlencoded")
    body = await form_body(request)
    pairs = parse_qsl(body.decode("utf-8", "replace"))
    if has_nul(pairs):
        raise HTTPException(400, "a NUL byte in the form")
    fields: dict[str, str] = {}
    for name, value in pairs:
        fields.setdefault(name, value)
    cookie = request.cookies.get(CSRF_COOKIE, "")
    offered = fields.pop(CSRF_FIELD, "")
    if not cookie or not hmac.compare_digest(cookie.encode(), offered.encode()):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
    return fields
