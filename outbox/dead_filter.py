"""DeadFilter: which dead messages a list or a decision is about."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeadFilter:
    """Which dead messages: by destination, last status, error text, and age in seconds."""

    destination: str | None = None
    status: int | None = None
    error: str | None = None
    """Text the last error contains (case-insensitive)."""
    newer_than: float | None = None
    older_than: float | None = None
    after: int | None = None
    """Only those after this message id (the next page of a list, which is in id order)."""
    ids: tuple[int, ...] | None = None
    """Only these message ids: a decision about the dead messages an operator counted and
    confirmed, not about others that matched the filter since."""
