"""Who may use the console, and what a browser may do with its pages: the Guard.

With a token configured (OUTBOX_CONSOLE_TOKEN; required off loopback), every
request but the login form's must carry it: as `Authorization: Bearer`, or as the
session cookie the login form sets (login_sessions). Wrong tokens, at the form or as
a bearer, are limited per client address (guesses). Every POST must carry the CSRF
token of the double-submit cookie in its form (forms). A forced requeue must carry
the confirmation the console issued with its refusal (confirmations). Every response
carries a Content-Security-Policy that allows no script at all. A loopback console
answers only requests that name it, and a POST from another origin is refused
(hosts).
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp

from outbox_cli.console.forms import CSRF_COOKIE, has_nul
from outbox_cli.console.guesses import GuessLimit, too_many_guesses
from outbox_cli.console.hosts import foreign_origin, host_name
from outbox_cli.console.login_sessions import Sessions, session_of

OPEN_PATHS = frozenset({"/login", "/static/console.css"})
"""Answered without the token: the login form and the style sheet it uses."""
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: under it a browser sends `Origin: null` with the console's own
    # forms, which the Origin check would refuse; same-origin still tells no other site.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
Unauthorized = Callable[[Request], Awaitable[Response]]
log = logging.getLogger("outbox.console")


def token_matches(token: str, offered: str) -> bool:
    """Whether `offered` is the token, in time that does not depend on where they differ."""
    return hmac.compare_digest(token.encode(), offered.encode())


def bearer(request: Request) -> str:
    """The token of the request's `Authorization: Bearer` header ("" when none)."""
    scheme, _, offered = request.headers.get("authorization", "").partition(" ")
    return offered.strip() if scheme.lower() == "bearer" else ""


def authenticated(request: Request, token: str | None, sessions: Sessions | None) -> bool:
    """Whether the request carries the token (bearer header) or an open session's cookie."""
    if token is None:
        return True
    offered = bearer(request)
    if offered:
        return token_matches(token, offered)
    return session_of(request, sessions) is not None


def client_address(request: Request) -> str:
    """The address the request came from (no proxy is trusted to say otherwise)."""
    return request.client.host if request.client is not None else ""


def secure(request: Request) -> bool:
    """Whether cookies set in answer to `request` are Secure: only when it came over https
    (no proxy is trusted to say so)."""
    return request.url.scheme == "https"


class Guard(BaseHTTPMiddleware):
    """Refuses requests without the token, hands out the CSRF cookie, adds the headers."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        unauthorized: Unauthorized,
        hosts: frozenset[str] | None,
        guesses: GuessLimit,
        sessions: Sessions | None,
    ) -> None:
        """`unauthorized` answers a request without the token (a 401 login page); `hosts`
        are the Host headers answered (None: any, see allowed_hosts); `guesses` limits
        wrong bearer tokens, as it limits the login form's."""
        super().__init__(app)
        self.token = token
        self.unauthorized = unauthorized
        self.hosts = hosts
        self.guesses = guesses
        self.sessions = sessions

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """Check the Host, the Origin and the token, then answer with the security headers
        and the CSRF cookie."""
        known = request.cookies.get(CSRF_COOKIE)
        request.state.csrf = known or secrets.token_urlsafe(32)
        # Who is signed in, for the pages (their name) and the requeue (its audit).
        request.state.session = session_of(request, self.sessions)
        given = request.headers.getlist("host")
        # One header: with two, one layer may read the first and another the last.
        named = host_name(given[0]) if len(given) == 1 else None
        if named is None:
            response: Response = PlainTextResponse("400: one Host header, host[:port]", 400)
        elif self.hosts is not None and named not in self.hosts:
            response = PlainTextResponse("400: not a name of this console", 400)
        elif request.method == "POST" and foreign_origin(request):
            response = PlainTextResponse("403: the form's Origin is not this console", 403)
        elif has_nul(request.query_params.multi_items()):
            # PostgreSQL refuses a NUL in text: the query would fail (500) instead of
            # finding nothing, and no name, id or filter of the console holds one.
            response = PlainTextResponse("400: a NUL byte in the query", 400)
        elif (wait := self.guessing(request)) > 0:
            response = too_many_guesses(wait)
        elif request.url.path in OPEN_PATHS:
            # The login page answers a right bearer token apart from a wrong one (it
            # redirects): a wrong one counts here as anywhere.
            offered = bearer(request)
            if offered and self.token is not None and not token_matches(self.token, offered):
                self.guesses.wrong(client_address(request))
            response = await answered(request, call_next)
        elif authenticated(request, self.token, self.sessions):
            response = await answered(request, call_next)
        else:
            if bearer(request) and self.token is not None:
                self.guesses.wrong(client_address(request))
            response = await self.unauthorized(request)
        response.headers.update(SECURITY_HEADERS)
        if known is None:
            response.set_cookie(
                CSRF_COOKIE,
                request.state.csrf,
                httponly=True,
                samesite="strict",
                secure=secure(request),
                path="/",
            )
        return response

    def guessing(self, request: Request) -> int:
        """Seconds a request offering a bearer token must wait first (0: none), checked
        before the token is: an answer that told a right token apart would be a guess."""
        if self.token is None or not bearer(request):
            return 0
        return self.guesses.wait(client_address(request))


async def answered(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """The page's answer; a failure is a short 500 and one log line naming its kind.

    Not the traceback: a database error quotes its statement's parameters, which are
    what the request asked for, and the server's own handler logs it whole.
    """
    try:
        return await call_next(request)
    except Exception as exc:  # noqa: BLE001 - any page's failure is answered alike
        log.error("console: %s %s failed: %s", request.method, request.url.path, type(exc).__name__)
        return PlainTextResponse("500: the console failed to answer; its log says how", 500)
