"""Durations for people: 30d, 2h, 90s, in the form the commands' duration flags read."""

from __future__ import annotations

_UNITS = (("d", 86_400), ("h", 3_600), ("m", 60))


def duration_text(seconds: float) -> str:
    """`seconds` in the largest unit that divides it: 30d, 2h, 90m, 90s (1.5s when not whole)."""
    if seconds > 0 and seconds == int(seconds):
        whole = int(seconds)
        for unit, size in _UNITS:
            if whole % size == 0:
                return f"{whole // size}{unit}"
        return f"{whole}s"
    return f"{seconds:g}s"
