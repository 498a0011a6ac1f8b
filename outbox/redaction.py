"""Redaction: what may hold a credential is hidden before text is stored, logged or printed.

A destination URL may carry a password (userinfo) or a token (query string), and
a webhook secret may be mistyped into a command line; errors and logs show neither.
"""

from __future__ import annotations

import re

SECRET_LIKE = re.compile(r"whsec_[A-Za-z0-9+/=_-]*")

# scheme://[userinfo@]rest[?query][#fragment], the parts that may hold credentials marked.
_URL = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/@'\"]*@)?(?P<rest>[^\s?#'\"]*)(?P<query>\?[^\s#'\"]*)?(?P<fragment>#[^\s'\"]*)?"
)


def redact_urls(text: str) -> str:
    """`text` with every URL's userinfo and query string (tokens, passwords) hidden."""

    def hide(found: re.Match[str]) -> str:
        userinfo = "<redacted>@" if found["userinfo"] else ""
        query = "?<redacted>" if found["query"] else ""
        return f"{found['scheme']}{userinfo}{found['rest']}{query}"

    return _URL.sub(hide, text)


def redact(text: str) -> str:
    """`text` with URL credentials and anything shaped like a webhook secret hidden."""
    return SECRET_LIKE.sub("whsec_<redacted>", redact_urls(text))
