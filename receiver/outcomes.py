"""What a broker consumer makes of each message it fetched, and how the broker is told.

See receiver.consume for when each outcome is given.
"""

from __future__ import annotations

from typing import Literal

Outcome = Literal["stored", "duplicate", "conflict", "invalid", "retry", "held", "dead"]
ACKNOWLEDGED: frozenset[Outcome] = frozenset({"stored", "duplicate", "conflict", "dead"})
"""Outcomes the broker is told are done with: they are never delivered again."""
REDELIVERED: frozenset[Outcome] = frozenset({"retry", "held"})
"""Outcomes left to the broker to deliver again: nothing of them was applied."""
