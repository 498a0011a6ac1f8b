"""Strict JSON's shortcuts: the exact parse's walk skipped when the text proves it needless,
and orjson's fast path, which may only accept what the exact parse accepts, with its value."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import fuzz
from support.optional import require

from receiver import strict_json
from receiver.rules import MAX_DEPTH, InvalidJSON, parse_strict_json
from receiver.strict_json import check_strict_json


def test_nesting_exactly_at_the_limit_is_accepted() -> None:
    body = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_strict_json(body) is not None


def test_nesting_one_over_the_limit_is_refused_even_among_many_brackets() -> None:
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    with pytest.raises(InvalidJSON, match="nesting"):
        parse_strict_json(b'{"a":' + deep + b"}")


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    body = b'{"a":"' + b"[{" * (MAX_DEPTH + 1) + b'"}'
    assert parse_strict_json(body) == {"a": "[{" * (MAX_DEPTH + 1)}


def test_an_escaped_backslash_before_u_is_not_an_escape() -> None:
    # The text holds a backslash then "u0000": no NUL, so it is accepted after the walk.
    assert parse_strict_json(b'{"a":"\\\\u0000"}') == {"a": "\\u0000"}


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":[1,{"b":"\\u0000"}]}',
        b'[[{"k":"\\udfff"}]]',
        b'{"ok":1,"x":{"\\u0000":1}}',
    ],
)
def test_escapes_deep_in_the_document_are_still_checked(body: bytes) -> None:
    with pytest.raises(InvalidJSON):
        parse_strict_json(body)


# The strict-JSON rows of the bad-input catalogue (test_receiver_app.py), and more that
# the fast path's own checks must not let through.
REFUSED = [
    b"",
    b'{"a":"\xff"}',
    b'{"a":"\xc0\xaf"}',
    b'\xef\xbb\xbf{"a":1}',
    '{"a":1}'.encode("utf-16"),
    b'{"a":NaN}',
    b'{"a":Infinity}',
    b'{"a":-Infinity}',
    b'{"a":1,"a":2}',
    b'{"x":{"a":1,"a":1}}',
    b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    b"[" * 3000 + b"]" * 3000,
    b'{"a":"\\ud800"}',
    b'{"\\udfff":1}',
    b'{"a":"\\u0000"}',
    b'{"\\u0000":1}',
    b'{"a":"\x01"}',
    b'{"a":',
    b'{"a":1} x',
    b"{'a':1}",
    b'{"a":' + b"9" * 5000 + b"}",
    b"1e400",
    b'{"a":"x:y","a":1}',  # a colon inside a string must not stand in for a lost pair
    b'{"a":1,"a":"x:"}',
    b'[{"a":1},{"b":1,"b":2}]',
    b'{"a":"\\u003a","a":1}',  # an escaped colon
    b'{"a\\u0000b":1}',
    b'"\\ud83d"',
    # Long enough to be walked rather than counted.
    b'{"pad":"' + b"x" * 5000 + b'","a":' + b"[" * (MAX_DEPTH) + b"]" * (MAX_DEPTH) + b"}",
]

ACCEPTED = [
    b'{"kind":"result","n":3,"payload":"xxx"}',
    b'{"a:b":1}',
    b'{"a":"x:y","b":{"c":[1,2,{"d":"e:f"}]}}',
    b"[18446744073709551616, -9223372036854775809, 9223372036854775808]",
    b'{"n":1' + b"0" * 30 + b', "f":0.1000000000000000055511151231257827}',
    b'"\\ud83d\\ude00"',
    b'"\\u00e9 \\\\u0000"',
    b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
    b'[{"pad":"' + b"x" * 5000 + b'"},' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"]",
    b' {"a" : [ 1 , 2 ] }\n',
    b"-0",
    b"1e-400",
    b'{"replies":' + b"[" + b",".join([b'{"r":"x","b":"{\\"k\\":1}"}'] * 200) + b"]}",
]


def _modes() -> list[Any]:
    exact = pytest.param(None, id="exact-only")
    try:
        import orjson
    except ImportError:
        return [exact, pytest.param(None, id="orjson", marks=pytest.mark.skip("no orjson"))]
    return [exact, pytest.param(orjson, id="orjson")]


@pytest.fixture(params=_modes())
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Parse with orjson's fast path, or as without the `fast` extra: the exact parse only."""
    monkeypatch.setattr(strict_json, "orjson", request.param)
    return "orjson" if request.param is not None else "exact-only"


def _exact_refusal(body: bytes) -> str:
    with pytest.raises(InvalidJSON) as refused:
        strict_json._exact(body, MAX_DEPTH)
    return str(refused.value)


@pytest.mark.parametrize("body", REFUSED)
def test_every_path_refuses_with_the_exact_reason(mode: str, body: bytes) -> None:
    reason = _exact_refusal(body)
    with pytest.raises(InvalidJSON) as parsed:
        parse_strict_json(body)
    with pytest.raises(InvalidJSON) as checked:
        check_strict_json(body)
    assert str(parsed.value) == str(checked.value) == reason


@pytest.mark.parametrize("body", ACCEPTED)
def test_every_path_accepts_with_the_exact_value(mode: str, body: bytes) -> None:
    exact = strict_json._exact(body, MAX_DEPTH)
    assert _typed(parse_strict_json(body)) == _typed(exact)
    check_strict_json(body)


def _typed(value: Any) -> Any:
    """The value with each scalar's type beside it: 1 == 1.0 == True must not pass here."""
    if isinstance(value, dict):
        return {key: _typed(child) for key, child in value.items()}, list(value)
    if isinstance(value, list):
        return [_typed(child) for child in value]
    return type(value).__name__, repr(value)


def test_the_fast_path_proves_the_usual_bodies() -> None:
    require("orjson")
    usual = b'{"replies":[{"reply_id":"r-1","body":"{\\"kind\\":\\"result\\",\\"n\\":1}"}]}'
    assert strict_json._fast_path(usual, MAX_DEPTH, exact_numbers=True) == json.loads(usual)
    item = b'{"kind":"result","n":1,"payload":"xxxx"}'
    assert strict_json._fast_path(item, MAX_DEPTH, exact_numbers=False) == json.loads(item)


_TOKENS = [
    b"{", b"}", b"[", b"]", b":", b",", b'"', b'"a"', b'"b"', b'"a:"', b"1", b"-", b".", b"e",
    b"9" * 19, b"\\", b"\\u", b"\\u0000", b"\\ud800", b"\\udc00", b'\\"', b"null", b"NaN",
    b" ", b"\n", b"\x00", b"\x01", b"\xc3\xa9", b"\xff", b"\xed\xa0\x80", b"\xef\xbb\xbf",
    b"1e400", b"1.5",
]  # fmt: skip


def _scalars() -> st.SearchStrategy[Any]:
    return (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text()
    )


_DOCUMENTS = st.recursive(
    _scalars(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    """JSON that is mostly valid, with a token spliced in, or a pair repeated, now and then."""
    if draw(st.booleans()):
        return b"".join(draw(st.lists(st.sampled_from(_TOKENS), max_size=12)))
    text = json.dumps(draw(_DOCUMENTS), ensure_ascii=draw(st.booleans()), allow_nan=False)
    body = text.encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        at = draw(st.integers(0, len(body)))
        body = body[:at] + draw(st.sampled_from([*_TOKENS, b'"a":1,', b',"a":1'])) + body[at:]
    return body


@settings(
    max_examples=fuzz.examples(3000), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(body=_bodies(), depth=st.sampled_from([1, 2, MAX_DEPTH]))
def test_the_fast_path_never_accepts_what_the_exact_parse_refuses(body: bytes, depth: int) -> None:
    require("orjson")
    try:
        exact = strict_json._exact(body, depth)
    except InvalidJSON:
        exact = strict_json._UNPROVEN
    value = strict_json._fast_path(body, depth, exact_numbers=True)
    if value is not strict_json._UNPROVEN:
        assert exact is not strict_json._UNPROVEN, body
        assert _typed(value) == _typed(exact), body
    checked = strict_json._fast_path(body, depth, exact_numbers=False)
    if checked is not strict_json._UNPROVEN:
        assert exact is not strict_json._UNPROVEN, body
