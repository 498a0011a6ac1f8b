"""The one backoff formula: how long to wait after the n-th failure in a row.

The ceiling doubles per failure from `backoff` up to `cap`; the delay is drawn
uniformly in [ceiling/2, ceiling], so that the many parties a shared fault failed
at once (tasks, deliveries, broker consumers) do not all come back at the same
moment. Used by the task queue's retries, the relay's redeliveries (with the
Retry-After hint on top, relay.policy) and the broker consumers' pause.
"""

from __future__ import annotations

import random

# 2**62 seconds is past any cap: the exponent stops there rather than overflow a float.
MAX_EXPONENT = 62


def backoff_ceiling(attempt: int, backoff: float, cap: float) -> float:
    """The longest wait after failure `attempt` (the first is 1): min(cap, backoff * 2^(n-1))."""
    return min(cap, backoff * 2.0 ** min(max(attempt - 1, 0), MAX_EXPONENT))


def backoff_delay(attempt: int, backoff: float, cap: float, rng: random.Random) -> float:
    """The wait after failure `attempt`: uniform in [d/2, d], d = backoff_ceiling(...)."""
    ceiling = backoff_ceiling(attempt, backoff, cap)
    return rng.uniform(ceiling / 2, ceiling)
