"""Argument types shared by the `outbox` subcommands: bad input is a one-line exit 2."""

from __future__ import annotations

import argparse
import math
import re

_DURATION = re.compile(r"(\d+)([dhms]?)")
_UNIT_SECONDS = {"d": 86_400, "h": 3_600, "m": 60, "s": 1, "": 1}


def parse_duration(text: str) -> float:
    """Seconds in a duration like 30d, 12h, 90m, 45s (a bare number is seconds)."""
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a positive number with d, h, m or s (e.g. 30d)"
        )
    return float(int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def non_empty(text: str) -> str:
    """A string that is not blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text
