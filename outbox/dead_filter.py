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
    through: int | None = None
    """Only those up to this message id: a decision about the messages an operator counted
    and confirmed, not about those that died since."""
