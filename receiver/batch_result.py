"""What one transaction of the receipt store did with each item of a batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class BatchResult(NamedTuple):
    """A status per item, and what accept() reports from them."""

    statuses: list[str]
    digests: list[str]
    inserted: dict[str, float]
    """received_at of each receipt this transaction stored."""
    held: dict[str, tuple[str, float]]
    """content hash and received_at of each receipt that was stored before it."""
    errors: dict[int, str]
    """Why each `retry` item failed, by index (isolated batches only)."""


def item_status(
    index: int,
    first: int,
    digests: Sequence[str],
    held: tuple[str, float] | None,
) -> str:
    """stored, duplicate or conflict for item `index`, whose reply_id first came at `first`."""
    if held is None and index == first:
        return "stored"
    stored_hash = digests[first] if held is None else held[0]
    return "duplicate" if stored_hash == digests[index] else "conflict"
