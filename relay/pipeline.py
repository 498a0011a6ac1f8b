"""The loop's bookkeeping: a claimed batch split per destination, and each one's pipeline.

A claimed batch is split by destination, and each part is delivered and
settled on its own, so a destination that hangs holds up only its own
messages. A destination with PIPELINE parts posting is left out of claims.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import NamedTuple

from relay.records import Message

PIPELINE = 2  # parts delivering at once per destination: one POSTs while the next claims


class Claimed(NamedTuple):
    """A claimed batch, or one destination's part of it, as the relay delivers it."""

    deliver: list[Message]
    resolve: list[Message]
    """Messages whose attempts are spent: resolved by receipt lookup, never sent."""
    deadline: float
    """The monotonic time by which every attempt must end: the lease less a margin."""


def by_destination(claimed: Claimed) -> list[tuple[str, Claimed]]:
    """Split a claimed batch into one part per destination, each with the batch's deadline."""
    parts: dict[str, Claimed] = defaultdict(lambda: Claimed([], [], claimed.deadline))
    for message in claimed.deliver:
        parts[message.destination].deliver.append(message)
    for message in claimed.resolve:
        parts[message.destination].resolve.append(message)
    return list(parts.items())


class Pipeline:
    """One destination's parts in run(): posting until delivered, unfinished until settled."""

    def __init__(self) -> None:
        """Nothing in flight."""
        self.posting: set[asyncio.Future[None]] = set()
        self.unfinished: set[asyncio.Future[None]] = set()

    def add(self, delivered: asyncio.Future[None], turn: asyncio.Future[None]) -> None:
        """Track a part: `delivered` resolves after its POSTs, `turn` after its settle."""
        self.posting.add(delivered)
        self.unfinished.add(turn)

    def full(self) -> bool:
        """PIPELINE parts posting, or more than PIPELINE not yet settled: claim none now."""
        self.posting = {f for f in self.posting if not f.done()}
        self.unfinished = {f for f in self.unfinished if not f.done()}
        # A settle never holds up the next claim (they touch different rows), but at most
        # PIPELINE + 1 parts per destination are unfinished at once.
        return len(self.posting) >= PIPELINE or len(self.unfinished) > PIPELINE
