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
from urllib.parse import quote, unquote, unquote_plus, urlsplit

SECRET_LIKE = re.compile(r"whsec_[A-Za-z0-9+/=_-]*")

# scheme://[user[:password]@]rest[?query][#fragment], the parts that may hold credentials
# marked. A password may hold '@' (unencoded, in a mistyped URL): the userinfo runs to the
# authority's last '@'. SQLAlchemy takes a password with '/', '?' or '#' in it too: after
# "user:", the userinfo runs to the URL's last '@' (a host cannot hold one), at the cost of
# hiding a host whose path or query holds both ':' and '@'.
_URL = re.compile(
    # A scheme starts where a run of scheme characters starts: tried at every letter of a
    # long run, the match would scan the rest of it each time (time growing with the
    # square of a long error's words).
    r"(?<![A-Za-z0-9+.-])(?P<lead>[0-9+.-]*)(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)"
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
        shown = f"{_shown_userinfo(found)}{found['rest']}{_shown_query(found)}"
        return f"{found['lead']}{found['scheme']}{shown}"

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
"""Shorter values are not hidden where they are quoted alone: a value of one or two
characters would blank out every digit of an error. The query string as a whole is
always hidden, and so is the start of a credential that an error's cut leaves."""
_CREDENTIAL_NAME = re.compile(
    r"key|token|secret|sig|auth|pass|pwd|code|credential|session|jwt", re.IGNORECASE
)
_PERCENT_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def _looks_secret(name: str, value: str) -> bool:
    """A query value worth hiding wherever it is quoted: named like a credential, or
    random-looking (letters and digits, 8 characters or more). `api-version=2024-01-01`
    is neither, and hiding it would blank every date of an error."""
    if _CREDENTIAL_NAME.search(name):
        return True
    return len(value) >= 8 and any(c.isalpha() for c in value) and any(c.isdigit() for c in value)


def _spellings(value: str) -> list[str]:
    """How a destination may quote `value` back: as sent, decoded (with '+' as space or
    not), encoded again with either case of hex, and with '/' escaped as JSON may."""
    decoded = unquote(value)
    again = quote(decoded, safe="")
    forms = [value, decoded, unquote_plus(value), again, decoded.replace("/", "\\/")]
    forms += [_PERCENT_ESCAPE.sub(lambda m: m[0].lower(), form) for form in (value, again)]
    return forms


def url_credentials(url: str) -> list[str]:
    """What in `url` may be a credential, as a destination could quote it back: the query
    string, its credential-like values, and the password (or a user name standing alone,
    a token then) of its userinfo, each in the spellings a quote may take."""
    parts = urlsplit(url)
    found = _spellings(parts.query) if parts.query else []
    for pair in parts.query.split("&"):
        name, _, value = pair.partition("=")
        if _looks_secret(unquote_plus(name), unquote_plus(value)):
            found += _spellings(value)
    userinfo = parts.netloc.rpartition("@")[0]
    user, colon, password = userinfo.partition(":")
    # The user name before a password stays, as redact_urls shows it.
    found += _spellings(password) if colon else _spellings(user)
    return [text for text in dict.fromkeys(found) if len(text) >= MIN_QUOTED_SECRET]


def redact_quoted(text: str, credentials: Iterable[str]) -> str:
    """`text` with each of `credentials` hidden wherever it appears, whatever surrounds it,
    and the start of one that the text's cut left at its end; then redact()ed: an answer
    may quote a token outside any URL."""
    ordered = sorted(set(credentials), key=len, reverse=True)
    for credential in ordered:
        text = text.replace(credential, "<redacted>")
    return redact(_without_cut_credential(text, ordered))


def _without_cut_credential(text: str, credentials: Iterable[str]) -> str:
    """`text` with a credential's first characters hidden where they end it before a
    cut's mark ("…"): an error is cut to its length limit before it is stored."""
    if not text.endswith("…"):
        return text  # not cut: a word that starts like a credential is only a word
    body = text[:-1].rstrip()
    for credential in credentials:
        for length in range(min(len(credential) - 1, len(body)), MIN_QUOTED_SECRET - 1, -1):
            if body.endswith(credential[:length]):
                return body[:-length] + "<redacted>" + text[len(body) :]
    return text


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
