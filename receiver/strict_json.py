"""Strict JSON: what the receiver accepts as a body, and what it refuses with which reason.

The rules are those of the exact parse, the standard library's decoder with
Python hooks: UTF-8 only, no BOM, no NaN/Infinity, no number out of a float's
range, no duplicate keys, nesting at most ``MAX_DEPTH``, no lone surrogates and
no NUL in strings or keys. Its hook runs for every object, which for a batch of
1,000 replies is the receiver's largest single cost.

With orjson installed (the ``fast`` extra), a body first takes a fast path
that can only prove it acceptable: orjson's C parse, which already refuses
invalid UTF-8, a BOM, NaN and Infinity, numbers out of range, control
characters and lone surrogates, then checks that are exact or err towards
doubt:

* no ``\\u`` escape in the bytes: only an escape can produce a NUL (or a lone
  surrogate), and no escape can hide a colon from the count below;
* as many ``:`` in the compact re-serialization as in the body: a duplicate
  key drops a pair, and with it the pair's colon, while colons inside strings
  stay (one flat object with as many keys as colons needs no re-serialization);
* nesting within the limit: certain when the body is too short or has too few
  brackets to nest deeper, else counted level by level over the containers;
* where the value is used, no run of 19 digits: orjson reads an integer
  outside 64 bits as a float, where the exact parse keeps an int.

Anything the fast path cannot prove, a refusal included, goes to the exact
parse, which alone decides what is refused and says why: a body is refused by
the same rule and with the same message whether orjson is installed or not
(without it, every body takes the exact parse).
"""

from __future__ import annotations

import json
import math
from typing import Any

try:
    import orjson
except ImportError:  # the `fast` extra is not installed: the exact parse alone
    orjson = None  # type: ignore[assignment]

MAX_DEPTH = 64


class InvalidJSON(ValueError):
    """The body is not strict JSON."""


def _reject_constant(name: str) -> Any:
    raise InvalidJSON(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        # 1e400 is valid JSON text but no float: it would be read as infinity.
        raise InvalidJSON(f"number {text[:40]} is out of range")
    return value


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise InvalidJSON("duplicate key in an object")
    return result


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise InvalidJSON("NUL character in a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidJSON("lone surrogate in a string") from exc


# One decoder for every call: json.loads would build a new one per call with these hooks.
_STRICT_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, object_pairs_hook=_unique_object, parse_float=_finite_float
)
_DIGITS_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_LONG_NUMBER = b"0" * 19
"""19 digits in a row: possibly an integer outside 64 bits, which orjson reads as a float."""


def parse_strict_json(body: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Parse strict JSON from UTF-8 bytes, or raise InvalidJSON."""
    if orjson is not None:
        value = _fast_path(body, max_depth, exact_numbers=True)
        if value is not _UNPROVEN:
            return value
    return _exact(body, max_depth)


def check_strict_json(body: bytes, max_depth: int = MAX_DEPTH) -> None:
    """Raise InvalidJSON unless `body` is strict JSON (parse_strict_json, value unused)."""
    if orjson is None or _fast_path(body, max_depth, exact_numbers=False) is _UNPROVEN:
        _exact(body, max_depth)


_UNPROVEN: Any = object()


def _fast_path(body: bytes, max_depth: int, *, exact_numbers: bool) -> Any:
    """orjson's value, when the exact parse certainly accepts `body`; else _UNPROVEN.

    With `exact_numbers`, also only when the exact parse returns the same value.
    """
    # A backslash is rare outside batch requests: looking for one byte is the cheaper test.
    if b"\\" in body and b"\\u" in body:
        return _UNPROVEN
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _UNPROVEN  # the exact parse says why
    if exact_numbers and _LONG_NUMBER in body.translate(_DIGITS_AS_ZEROS):
        return _UNPROVEN
    colons = body.count(b":")
    # One flat object with a key per colon has no duplicate; else count re-serialized.
    if colons and not (type(value) is dict and len(value) == colons):
        try:
            compact = orjson.dumps(value)
        except orjson.JSONEncodeError:  # nested too deep for it
            return _UNPROVEN
        if compact.count(b":") != colons:
            return _UNPROVEN
    if _may_nest_too_deep(body, max_depth) and _deeper_than(value, max_depth):
        return _UNPROVEN
    return value


_COUNTED_UP_TO = 4096
"""Bytes of a body whose brackets are counted; a longer one is walked: that costs less."""


def _may_nest_too_deep(body: bytes, max_depth: int) -> bool:
    """False when the bytes alone show nesting within `max_depth`."""
    if len(body) < 2 * (max_depth + 1):
        return False  # each level takes an opening and a closing bracket
    if len(body) > _COUNTED_UP_TO:
        return True
    return body.count(b"[") + body.count(b"{") > max_depth


def _deeper_than(value: Any, max_depth: int) -> bool:
    """Whether more than `max_depth` containers nest in `value`; one pass per level."""
    level = [value] if type(value) in (dict, list) else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        level = [
            child
            for item in level
            for child in (item.values() if type(item) is dict else item)
            if type(child) is dict or type(child) is list
        ]
    return False


def _exact(body: bytes, max_depth: int) -> Any:
    """The exact parse: every rule, and the reason for a refusal."""
    if body.startswith(b"\xef\xbb\xbf"):
        raise InvalidJSON("byte order mark before JSON")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSON("body is not UTF-8") from exc
    try:
        value = _STRICT_DECODER.decode(text)
    except RecursionError as exc:
        raise InvalidJSON(f"nesting deeper than {max_depth}") from exc
    except ValueError as exc:  # JSONDecodeError, InvalidJSON, too many int digits
        raise InvalidJSON(str(exc)) from exc
    # Strict UTF-8 decoding and the decoder refuse raw NULs and surrogates, so only a \u
    # escape can produce one; and fewer brackets than the limit cannot nest too deep.
    # Most bodies pass both tests and need no walk.
    check_text = "\\u" in text
    check_depth = text.count("[") + text.count("{") > max_depth
    if check_text or check_depth:
        _walk(value, max_depth, check_text)
    return value


def _walk(value: Any, max_depth: int, check_text: bool) -> None:
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if check_text:
                _check_text(item)
        elif isinstance(item, dict | list):
            if depth >= max_depth:
                raise InvalidJSON(f"nesting deeper than {max_depth}")
            if isinstance(item, dict):
                for key, child in item.items():
                    if check_text:
                        _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
