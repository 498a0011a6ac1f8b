"""The console's login sessions: a signed cookie, and the session this process holds.

The session cookie the login form sets holds its issue time, a nonce and an HMAC of
both keyed by the token, so the cookie never holds the token; it opens the console
while the session is open (Sessions): SESSION_SECONDS at most, until logout. The
session holds the name the operator gave at login, which the audit of their requeues
records.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from starlette.requests import Request

SESSION_COOKIE = "outbox_console_session"
SESSION_SECONDS = 12 * 3600
"""How long a login lasts: a session cookie older than this is refused."""
SESSION_PURPOSE = "outbox-console-session:"
ISSUED = re.compile(r"[0-9]{1,12}")
NONCE = re.compile(r"[A-Za-z0-9_-]{24}")
LIVE_SESSIONS = 1_024
"""Open sessions held at most; past that the oldest ends (as if logged out)."""


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


def session_of(request: Request, sessions: Sessions | None) -> Session | None:
    """The open session the request's cookie proves, or None."""
    if sessions is None:
        return None
    return sessions.opened(request.cookies.get(SESSION_COOKIE, ""))
