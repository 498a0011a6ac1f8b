"""Who may use the console, and what a browser may do with its pages.

With a token configured (OUTBOX_CONSOLE_TOKEN; required off loopback), every
request but the login form's must carry it: as `Authorization: Bearer`, or as
the session cookie the login form sets: its issue time, a nonce and an HMAC of both
keyed by the token, so the cookie never holds the token; it opens the console while
the session is open (Sessions): SESSION_SECONDS at most, until logout; the session holds
the name the operator gave at login, which the audit of their requeues records. Wrong tokens,
at the form or as a bearer, are limited per client address (GuessLimit): after GUESSES,
429 until one is earned back. Every POST must carry the CSRF token of the
double-submit cookie in its form: a cross-site form cannot read the cookie,
and SameSite=Strict keeps the browser from sending it along. A forced requeue must
carry the confirmation the console issued with its refusal (Confirmations). Every response
carries a Content-Security-Policy that allows no script at all.

A console bound to loopback answers only requests that name it: a Host header of
its own address or a loopback name (any port: a tunnel forwards from its own).
Without that, a page whose
name re-resolves to 127.0.0.1 (DNS rebinding) would be same-origin with a console
that asks no token. Off loopback the token is required and guards it: the names
operators reach it by are not known to it, and a rebinding page holds neither the
token nor the session cookie (which belongs to the console's real name). A POST
whose Origin header is present must come from the console's own origin.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl

from starlette.exceptions import HTTPException
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp

from outbox.clock import Clock

SESSION_COOKIE = "outbox_console_session"
SESSION_SECONDS = 12 * 3600
"""How long a login lasts: a session cookie older than this is refused."""
SESSION_PURPOSE = "outbox-console-session:"
ISSUED = re.compile(r"[0-9]{1,12}")
NONCE = re.compile(r"[A-Za-z0-9_-]{24}")
LIVE_SESSIONS = 1_024
"""Open sessions held at most; past that the oldest ends (as if logged out)."""
CONFIRM_SECONDS = 600.0
"""How long a forced requeue's confirmation lasts after the refusal that issued it."""
CONFIRMATIONS = 1_024
"""Confirmations held at most; past that the oldest is forgotten (its force refused)."""
CSRF_COOKIE = "outbox_console_csrf"
CSRF_FIELD = "csrf_token"
MAX_FORM_BYTES = 65_536
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
GUESSES = 10
"""Wrong tokens a client address may offer in a row before it must wait."""
GUESS_SECONDS = 6.0
"""How often a client address earns back one wrong token: ten a minute, sustained."""
GUESSERS = 4_096
"""Client addresses whose wrong tokens are remembered; past that the longest quiet is
forgotten, so that many addresses cannot fill the console's memory."""
HOST_HEADER = re.compile(
    r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::(?P<port>[0-9]{1,5}))?"
)
"""A Host header as the console takes it: a name or IPv4 address, or an IPv6 address in
brackets, then at most a port. Anything looser let a parser see a loopback name in a
header that names another host (`127.0.0.1:1@evil.example`, `[::1]evil.example`)."""
Unauthorized = Callable[[Request], Awaitable[Response]]
log = logging.getLogger("outbox.console")


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


def now() -> float:
    """The sessions' clock (epoch seconds)."""
    return time.time()


def session_value(token: str, issued: int, nonce: str) -> str:
    """The session cookie's value for `token`, issued at `issued` (epoch seconds) as session
    `nonce`: both, and an HMAC of them keyed by the token, which proves the token without
    holding it."""
    proof = hmac.new(token.encode(), f"{SESSION_PURPOSE}{issued}.{nonce}".encode(), hashlib.sha256)
    return f"{issued}.{nonce}.{proof.hexdigest()}"


@dataclass(frozen=True)
class Session:
    """One open session: its nonce, when it was issued, and who logged in."""

    nonce: str
    issued: int
    operator: str
    """The name given at login: what the audit of this session's requeues records."""


class Sessions:
    """The sessions the login form opened and logout has not ended, in memory.

    A signed cookie alone stayed valid for SESSION_SECONDS after logout, copied or not; a
    session is now also one this process holds, so logout ends it, and a restart, which a
    new token needs (the token is read once, at start), ends them all. At most
    LIVE_SESSIONS: past that the oldest ends.
    """

    def __init__(self, token: str) -> None:
        """Sessions proving `token`."""
        self.token = token
        self.live: OrderedDict[str, Session] = OrderedDict()
        """Each open session by its nonce, oldest first."""

    def new(self, operator: str) -> str:
        """A new session of `operator`'s, issued now: its cookie value."""
        issued, nonce = int(now()), secrets.token_urlsafe(18)
        self.live[nonce] = Session(nonce, issued, operator)
        while len(self.live) > LIVE_SESSIONS:
            self.live.popitem(last=False)
        return session_value(self.token, issued, nonce)

    def opened(self, cookie: str) -> Session | None:
        """The open session `cookie` proves (issued less than SESSION_SECONDS ago, not
        ended), or None."""
        issued, _, rest = cookie.partition(".")
        nonce, _, _ = rest.partition(".")
        if ISSUED.fullmatch(issued) is None or NONCE.fullmatch(nonce) is None:
            return None
        expected = session_value(self.token, int(issued), nonce)
        if not hmac.compare_digest(expected.encode(), cookie.encode()):
            return None
        session = self.live.get(nonce)
        if session is None or session.issued != int(issued):
            return None
        if not 0 <= now() - session.issued < SESSION_SECONDS:
            return None
        return session

    def end(self, cookie: str) -> None:
        """End the session `cookie` proves, if it is open: a copy of it no longer opens."""
        session = self.opened(cookie)
        if session is not None:
            del self.live[session.nonce]


@dataclass(frozen=True)
class Confirmation:
    """What a refusal offered to override: the lookup's answer it refused on, the reason
    the operator gave, and the secret that confirms it until `expires`."""

    token: str
    receipt: str
    reason: str
    expires: float


class Confirmations:
    """The confirmations a forced requeue needs, each issued with the refusal it overrides.

    Held by this process, not signed into the form: each is used once, which a signature
    alone could not promise without a record of the used ones anyway. Each is held under
    the session that saw the refusal and the reply it names, so a token shown to one
    session or for one reply confirms nothing else; a newer refusal replaces the older
    one's confirmation; any attempt to use one consumes it.
    """

    def __init__(
        self, clock: Clock, seconds: float = CONFIRM_SECONDS, held: int = CONFIRMATIONS
    ) -> None:
        """Confirmations that last `seconds` on `clock`, `held` of them at most."""
        self.clock = clock
        self.seconds = seconds
        self.most = held
        self.held: OrderedDict[tuple[str, str], Confirmation] = OrderedDict()
        """Per (session, reply_id) the confirmation issued last, the oldest first."""

    def issue(self, session: str, reply_id: str, receipt: str, reason: str) -> str:
        """A new confirmation of forcing `reply_id`'s requeue past `receipt`, for `session`."""
        now = self.clock()
        for key in [key for key, held in self.held.items() if held.expires <= now]:
            del self.held[key]
        token = secrets.token_urlsafe(32)
        self.held.pop((session, reply_id), None)
        self.held[(session, reply_id)] = Confirmation(token, receipt, reason, now + self.seconds)
        while len(self.held) > self.most:
            self.held.popitem(last=False)
        return token

    def redeem(self, session: str, reply_id: str, offered: str) -> Confirmation | None:
        """The confirmation `offered` is, if it was issued to `session` for `reply_id` and has
        neither expired nor been used; None otherwise. Either way it is used up."""
        held = self.held.pop((session, reply_id), None)
        if held is None or not hmac.compare_digest(held.token.encode(), offered.encode()):
            return None
        return held if self.clock() < held.expires else None


def token_matches(token: str, offered: str) -> bool:
    """Whether `offered` is the token, in time that does not depend on where they differ."""
    return hmac.compare_digest(token.encode(), offered.encode())


def bearer(request: Request) -> str:
    """The token of the request's `Authorization: Bearer` header ("" when none)."""
    scheme, _, offered = request.headers.get("authorization", "").partition(" ")
    return offered.strip() if scheme.lower() == "bearer" else ""


def session_of(request: Request, sessions: Sessions | None) -> Session | None:
    """The open session the request's cookie proves, or None."""
    if sessions is None:
        return None
    return sessions.opened(request.cookies.get(SESSION_COOKIE, ""))


def authenticated(request: Request, token: str | None, sessions: Sessions | None) -> bool:
    """Whether the request carries the token (bearer header) or an open session's cookie."""
    if token is None:
        return True
    offered = bearer(request)
    if offered:
        return token_matches(token, offered)
    return session_of(request, sessions) is not None


class GuessLimit:
    """Wrong tokens per client address, each address a token bucket GUESSES deep that
    refills one every GUESS_SECONDS; an empty bucket's next try is refused unchecked."""

    def __init__(
        self,
        clock: Clock = time.monotonic,
        guesses: int = GUESSES,
        seconds: float = GUESS_SECONDS,
        remembered: int = GUESSERS,
    ) -> None:
        """Buckets of `guesses`, refilled one per `seconds` on `clock`, for `remembered`
        addresses at most."""
        self.clock = clock
        self.guesses = guesses
        self.seconds = seconds
        self.remembered = remembered
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """Per address: the guesses left, and when that was counted; the least recently
        refused first."""

    def _left(self, address: str, now: float) -> float:
        """The guesses `address` has left at `now`."""
        left, counted = self.buckets.get(address, (float(self.guesses), now))
        return min(float(self.guesses), left + max(0.0, now - counted) / self.seconds)

    def wait(self, client: str) -> int:
        """Whole seconds before `client` may offer a token again (0: now)."""
        left = self._left(guesser(client), self.clock())
        return 0 if left >= 1 else max(1, math.ceil((1 - left) * self.seconds))

    def wrong(self, client: str) -> None:
        """Count a wrong token offered by `client`."""
        address, now = guesser(client), self.clock()
        left = self._left(address, now) - 1
        self.buckets.pop(address, None)
        self.buckets[address] = (left, now)
        while len(self.buckets) > self.remembered:
            self.buckets.popitem(last=False)


def guesser(client: str) -> str:
    """Who a client address's guesses count against: the address, or an IPv6 address's
    /64 (one host is given a whole /64 to pick addresses from)."""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client
    if address.version == 6 and address.ipv4_mapped is not None:
        # An IPv4 client of a dual-stack socket: its own address, not the /64 of them all.
        return str(address.ipv4_mapped)
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def client_address(request: Request) -> str:
    """The address the request came from (no proxy is trusted to say otherwise)."""
    return request.client.host if request.client is not None else ""


def too_many_guesses(wait: int) -> Response:
    """429 for a client that offered too many wrong tokens; Retry-After says when to retry."""
    return PlainTextResponse(
        f"429: too many wrong tokens; try again in {wait} s", 429, {"Retry-After": str(wait)}
    )


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


def has_nul(fields: Iterable[tuple[str, str]]) -> bool:
    """Whether a name or value of `fields` holds a NUL character."""
    return any("\x00" in name or "\x00" in value for name, value in fields)


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
