"""How many examples the fuzz tests draw: a short form in `make test`, the whole one in
`make test-long` (OUTBOXDEV_FUZZ=full), as the suite's other long forms run there."""

from __future__ import annotations

import os

FULL = os.environ.get("OUTBOXDEV_FUZZ", "") == "full"
"""Whether this run draws every fuzz test's whole count of examples."""
SHORT_SHARE = 5
"""`make test` draws a fifth of each count: the same properties, a minute less of CPU."""


def examples(whole: int) -> int:
    """A fuzz test's examples in this run: `whole` under OUTBOXDEV_FUZZ=full, else a fifth."""
    return whole if FULL else max(10, whole // SHORT_SHARE)
