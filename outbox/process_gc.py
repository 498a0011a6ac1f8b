"""Garbage collection for a long-running service process: the relay, worker and receiver.

CPython's cyclic collector runs a young collection every 700 net container
allocations and, every so often, a full one over every object it tracks. A relay
turn allocates some ten thousand short-lived objects per thousand messages (rows,
messages, outcomes, answers), so with the defaults the young collections run dozens
of times per turn and the full ones keep walking the whole start-up heap (the
modules of SQLAlchemy, the clients, the metrics): a fifth of a draining relay's CPU
here, measured with gc.callbacks. Freezing the start-up heap leaves it out of every
later collection, and a young threshold of YOUNG_THRESHOLD collects a turn's garbage
a few times instead. Reference cycles are still collected; memory bounds hold.

Only the command line's service processes call this: a library must not change the
collector of the process that embeds it.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Net container allocations between young collections (CPython's default: 700)."""


def tune_for_long_run() -> None:
    """Collect once, freeze what start-up built, and collect young objects less often."""
    # Garbage left from start-up is collected first, so that none of it is frozen for good.
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
