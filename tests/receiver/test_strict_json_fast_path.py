"""parse_strict_json skips its tree walk when the text proves it unnecessary: the edges."""

from __future__ import annotations

import pytest

from receiver.rules import MAX_DEPTH, InvalidJSON, parse_strict_json


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
