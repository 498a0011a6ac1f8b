"""Redaction: what may hold a credential is hidden before text is stored, logged or printed.

A destination or database URL may carry a password (userinfo) or a token (query
string), and a webhook secret may be mistyped into a command line; errors and logs
show neither. A URL's user name stays: without it a URL in an error could not be
told apart from another, nor pasted back into a command when it has no password.
"""

from __future__ import annotations

import re

SECRET_LIKE = re.compile(r"whsec_[A-Za-z0-9+/=_-]*")

# scheme://[user[:password]@]rest[?query][#fragment], the parts that may hold credentials
# marked. A password may hold '@' (unencoded, in a mistyped URL): the userinfo runs to the
# authority's last '@'.
_URL = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/?#'\"]*@)?(?P<rest>[^\s?#'\"]*)(?P<query>\?[^\s#'\"]*)?(?P<fragment>#[^\s'\"]*)?"
)


def redact_urls(text: str) -> str:
    """`text` with every URL's password and query string (tokens, passwords) hidden."""

    def hide(found: re.Match[str]) -> str:
        userinfo = found["userinfo"] or ""
        user, colon, _ = userinfo[:-1].partition(":")
        if colon:
            userinfo = f"{user}:<redacted>@"
        query = "?<redacted>" if found["query"] else ""
        return f"{found['scheme']}{userinfo}{found['rest']}{query}"

    return _URL.sub(hide, text)


def redact(text: str) -> str:
    """`text` with URL credentials and anything shaped like a webhook secret hidden."""
    return SECRET_LIKE.sub("whsec_<redacted>", redact_urls(text))
