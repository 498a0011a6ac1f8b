"""One line of a longer text: what logs, stored errors and listings show of it."""

from __future__ import annotations

CUT_MARK = "…"


def one_line(text: str, limit: int) -> str:
    """`text` on one line and printable (a peer's answer may hold a NUL), at most `limit`
    characters: a longer one is cut, its last character the cut mark."""
    flat = "".join(c if c.isprintable() else "?" for c in " ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 1] + CUT_MARK
