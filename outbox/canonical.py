"""Canonical JSON and content hashes: one byte form per value, so one hash per content."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

MAX_DEPTH = 16
MAX_NODES = 10_000
MAX_BYTES = 64 * 1024

JSONValue = Any
# Built once: json.dumps with options builds an encoder per call, which cost as much as the
# encoding of a small value (encode() keeps no state between calls).
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


class NotCanonical(ValueError):
    """A value cannot be put in canonical JSON form within the limits."""


def check_json_safe(
    value: object, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES
) -> None:
    """Raise NotCanonical unless `value` is plain JSON data within the depth and node limits."""
    nodes = 0
    on_path: set[int] = set()

    def walk(item: object, depth: int, where: str) -> None:
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes:
            raise NotCanonical(f"more than {max_nodes} nodes")
        if item is None or isinstance(item, bool):
            return
        if isinstance(item, str):
            _check_text(item, where)
            return
        if isinstance(item, int):
            return
        if isinstance(item, float):
            if not math.isfinite(item):
                raise NotCanonical(f"{where}: non-finite number {item!r}")
            return
        if isinstance(item, dict | list):
            if depth >= max_depth:
                raise NotCanonical(f"{where}: nesting deeper than {max_depth}")
            if id(item) in on_path:
                raise NotCanonical(f"{where}: cycle")
            on_path.add(id(item))
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise NotCanonical(f"{where}: key {key!r} is not a string")
                    _check_text(key, where)
                    walk(child, depth + 1, f"{where}.{key}")
            else:
                for index, child in enumerate(item):
                    walk(child, depth + 1, f"{where}[{index}]")
            on_path.discard(id(item))
            return
        raise NotCanonical(f"{where}: {type(item).__name__} is not JSON data")

    walk(value, 0, "$")


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise NotCanonical(f"{where}: string is not valid Unicode (lone surrogate)") from exc
    if "\x00" in text:
        # Receivers refuse NUL (and PostgreSQL text cannot hold it): fail at the write,
        # not later at delivery where the message could only go dead.
        raise NotCanonical(f"{where}: string contains a NUL character")


def canonical_bytes(
    value: JSONValue,
    *,
    max_bytes: int | None = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
) -> bytes:
    """Canonical JSON: sorted keys, no spaces, UTF-8 unescaped, NaN and Infinity refused."""
    check_json_safe(value, max_depth=max_depth, max_nodes=max_nodes)
    try:
        text = _CANONICAL.encode(value)
    except ValueError as exc:  # e.g. an int too long to render as text
        raise NotCanonical(str(exc)) from exc
    data = text.encode("utf-8")
    if max_bytes is not None and len(data) > max_bytes:
        raise NotCanonical(f"canonical form is {len(data)} bytes, more than {max_bytes}")
    return data


def sha256_hex(data: bytes) -> str:
    """Hex SHA-256 of the exact bytes."""
    return hashlib.sha256(data).hexdigest()


def content_hash(value: JSONValue) -> str:
    """SHA-256 of the canonical JSON of `value`."""
    return sha256_hex(canonical_bytes(value, max_bytes=None))
