"""Redaction: what may hold a credential is hidden before text is stored, logged or printed.

A destination or database URL may carry a password (userinfo) or a token (query
string), and a webhook secret may be mistyped into a command line; errors and logs
show neither. The user name before a password stays, so that a URL in an error can be
told apart from another. A user name alone is a credential (a NATS token, an API key)
and is hidden, but for a database URL: there it names a role, and a URL without a
password stays as typed so that it can be pasted back into a command.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

SECRET_LIKE = re.compile(r"whsec_[A-Za-z0-9+/=_-]*")

# scheme://[user[:password]@]rest[?query][#fragment], the parts that may hold credentials
# marked. A password may hold '@' (unencoded, in a mistyped URL): the userinfo runs to the
# authority's last '@'. SQLAlchemy takes a password with '/', '?' or '#' in it too: after
# "user:", the userinfo runs to the URL's last '@' (a host cannot hold one), at the cost of
# hiding a host whose path or query holds both ':' and '@'.
_URL = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)"
    r"(?P<userinfo>[^\s/?#'\"]*@|[^\s:/?#'\"@]*:[^\s'\"]*@)?"
    r"(?P<rest>[^\s?#'\"]*)(?P<query>\?[^\s#'\"]*)?(?P<fragment>#[^\s'\"]*)?"
)

# A user name alone is a role name in these (SQLAlchemy dialect names and their drivers).
_DATABASE_SCHEMES = ("postgres", "sqlite", "mysql", "mariadb")

# A URL's scheme, or what stands in for one in a URL that does not parse.
_LEADING_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/*")


def redact_urls(text: str) -> str:
    """`text` with every URL's credentials (password, token user name, query string) hidden."""

    def hide(found: re.Match[str]) -> str:
        return f"{found['scheme']}{_shown_userinfo(found)}{found['rest']}{_shown_query(found)}"

    return _URL.sub(hide, text)


def redact_unparsed_url(url: str) -> str:
    """A URL that does not parse, with everything between its scheme and last '@' hidden."""
    before, at, after = url.rpartition("@")
    if not at:
        return redact(url)
    scheme = _LEADING_SCHEME.match(before)
    rest, question, _ = after.partition("?")
    rest = rest.partition("#")[0]
    return f"{scheme[0] if scheme else ''}<redacted>@{rest}{'?<redacted>' if question else ''}"


def _shown_userinfo(found: re.Match[str]) -> str:
    """A URL's userinfo as shown: a password hidden, a user name alone only in a database URL."""
    userinfo = found["userinfo"]
    if not userinfo or userinfo == "@":
        return userinfo or ""
    user, colon, _ = userinfo[:-1].partition(":")
    if colon:
        return f"{user}:<redacted>@"
    if found["scheme"].lower().startswith(_DATABASE_SCHEMES):
        return userinfo
    return "<redacted>@"


def _shown_query(found: re.Match[str]) -> str:
    """A URL's query string as shown: hidden whole, since any parameter may be a token."""
    return "?<redacted>" if found["query"] else ""


def redact(text: str) -> str:
    """`text` with URL credentials and anything shaped like a webhook secret hidden."""
    return SECRET_LIKE.sub("whsec_<redacted>", redact_urls(text))


MIN_QUOTED_SECRET = 6
"""Shorter query values and user names are not hidden where they are quoted alone: a
value of one or two characters would blank out every digit of an error. The query string
as a whole is always hidden."""


def url_credentials(url: str) -> list[str]:
    """What in `url` may be a credential, as a destination could quote it back: the query
    string, each query value (raw and decoded) and the userinfo's user and password."""
    parts = urlsplit(url)
    found = [parts.query]
    for pair in parts.query.split("&"):
        value = pair.partition("=")[2]
        found += [value, unquote(value)]
    userinfo = parts.netloc.rpartition("@")[0]
    user, _, password = userinfo.partition(":")
    found += [userinfo, user, password, unquote(user), unquote(password)]
    return [text for text in found if len(text) >= MIN_QUOTED_SECRET]


def redact_quoted(text: str, credentials: Iterable[str]) -> str:
    """`text` with each of `credentials` hidden wherever it appears, whatever surrounds it,
    then redact()ed: an answer may quote a token outside any URL."""
    for credential in sorted(set(credentials), key=len, reverse=True):
        text = text.replace(credential, "<redacted>")
    return redact(text)


SHOWN_VALUE_CHARS = 12
"""A refused setting's value is quoted in its error up to this length: long enough for a
typo ("10 s", "yes please"), too short for a webhook secret or most tokens."""


def shown_value(value: object) -> str:
    """A refused value as an error shows it: quoted when short, else only its length, since
    a value in the wrong key or variable may be a secret."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= SHOWN_VALUE_CHARS and not SECRET_LIKE.search(text):
        return repr(value)
    return f"a value of {len(text)} characters (not shown: it could be a secret)"
