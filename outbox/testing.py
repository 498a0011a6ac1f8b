"""Helpers for tests of code built on the outbox: a manual clock and in-process failpoints.

ManualClock makes every lease, deadline and backoff comparison use a time the
test moves. `arm(name)` makes the next arrival at a failpoint raise Crash (a
BaseException), to test what a crash at that exact step leaves behind. A child
process instead takes OUTBOX_FAILPOINT from its environment, with the testing
switch OUTBOX_FAILPOINTS_ENABLED=1 (outbox.failpoints.environment builds both).
"""

from __future__ import annotations

from outbox.clock import ManualClock
from outbox.failpoints import POINTS, Crash, arm

__all__ = ["POINTS", "Crash", "ManualClock", "arm"]
