"""A destination's answer read as JSON: orjson where it accepts the body, and for what it
refuses, the standard library's decision, so the `fast` extra changes no outcome."""

from __future__ import annotations

import json
import math

import pytest

from relay import http_client
from relay.http_client import Response


def answer(body: bytes) -> Response:
    """A 200 answer with this body."""
    return Response(200, {}, body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"results": [{"reply_id": "r-1", "status": "stored"}]}',
        '{"reply_id": "é\\u00e9"}'.encode(),
        b'{"a": 1, "a": 2}',  # the last one wins in both
        b"[" * 600 + b"]" * 600,  # beyond orjson's depth, within the standard library's
        b'{"n": NaN, "i": -Infinity}',  # not JSON, yet the standard library takes it
        b'{"s": "\\ud800"}',  # a lone surrogate's escape
    ],
)
def test_every_body_reads_as_the_standard_library_reads_it(body: bytes) -> None:
    read, expected = answer(body).json(), json.loads(body)
    if isinstance(expected, dict) and "n" in expected:
        assert math.isnan(read["n"])
        assert read["i"] == expected["i"]
    else:
        assert read == expected


def test_orjson_reads_the_usual_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    if http_client.orjson is None:
        pytest.skip("the fast extra is not installed")
    monkeypatch.setattr(http_client.json, "loads", None)  # would raise if called
    assert answer(b'{"results": []}').json() == {"results": []}


def test_only_integers_beyond_64_bits_read_otherwise() -> None:
    # orjson reads them as floats; an answer's fields are strings (receiver-contract.md).
    big = b'{"n": 123456789012345678901234567890}'
    if http_client.orjson is not None:
        assert answer(big).json() == {"n": 1.2345678901234568e29}


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"[" * 100_000])
def test_what_is_not_json_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError, match=r"^Expecting |^answer nests too deep"):
        answer(body).json()
