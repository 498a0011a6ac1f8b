"""Argument types and value formats shared by the `outbox` subcommands.

Bad input is a one-line exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from datetime import UTC, datetime
from typing import Any

from outbox.redaction import shown_value

_DURATION = re.compile(r"(\d+)([dhms]?)")
_UNIT_SECONDS = {"d": 86_400, "h": 3_600, "m": 60, "s": 1, "": 1}


def parse_duration(text: str) -> float:
    """Seconds in a duration like 30d, 12h, 90m, 45s (a bare number is seconds)."""
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid duration {shown_value(text)}: use a positive number with d, h, m or s "
            "(e.g. 30d)"
        )
    return float(int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= {least}, got {shown_value(text)}"
        )
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    return _whole_number(text, 0)


def _seconds(text: str, zero_allowed: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0)):
        wanted = "a number >= 0" if zero_allowed else "a positive number"
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {shown_value(text)}")
    return value


def positive_float(text: str) -> float:
    """A number of seconds > 0."""
    return _seconds(text, zero_allowed=False)


def non_negative_float(text: str) -> float:
    """A number of seconds >= 0."""
    return _seconds(text, zero_allowed=True)


def boolean(text: str) -> bool:
    """true/false (also 1/0, yes/no), as a variable or the config file gives it."""
    value = text.strip().lower()
    if value not in ("true", "1", "yes", "false", "0", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {shown_value(text)}")
    return value in ("true", "1", "yes")


def non_empty(text: str) -> str:
    """A string that is not blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


LONGEST_OPERATOR = 200
"""Characters an operator's name may have: it goes into every audit row they write."""


def operator_name(text: str) -> str:
    """An operator's name as the audit records it: trimmed, 1 to LONGEST_OPERATOR printable
    characters (no control character, so a name cannot forge a line of a log)."""
    name = text.strip()
    if not name or len(name) > LONGEST_OPERATOR or not name.isprintable():
        raise argparse.ArgumentTypeError(
            f"an operator's name is 1 to {LONGEST_OPERATOR} printable characters"
        )
    return name


def age_text(seconds: float | None) -> str:
    """A duration for people: 42.0s, 3.5m, 2.0h, 1.5d; "none" for None."""
    if seconds is None:
        return "none"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def utc_iso(epoch: float | None) -> str | None:
    """Epoch seconds as ISO-8601 in UTC (`2026-12-03T21:55:46Z`); None for None."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def json_flag(parser: argparse.ArgumentParser) -> None:
    """--json: a command prints JSON for scripts instead of text."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def print_json(document: Any) -> None:
    """Print a document as indented JSON with sorted keys."""
    print(json.dumps(document, indent=2, sort_keys=True))
