"""Delivery policy without I/O: what an HTTP outcome means and when to try again.

Classification (docs/explanation/contract.md#delivery): 2xx is sent; 408, 425, 429 and 5xx, timeouts
and connection errors are worth retrying; 409 (same id, other body) and every
other status are permanent and the message goes dead at once.
"""

from __future__ import annotations

import email.utils
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from outbox.backoff import backoff_delay
from outbox.one_line import one_line
from outbox.states import MessageState

if TYPE_CHECKING:
    from relay.destination import Destination

RETRYABLE_STATUSES = frozenset({408, 425, 429})
ENDPOINT_REFUSALS = frozenset({401, 403, 404, 405, 407, 410})
"""Permanent statuses that refuse every request to the URL alike (credentials, a missing or
gone endpoint, a method it does not take), as a redirect (3xx) does: the destination's."""
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Sent:
    """The destination acknowledged the message."""

    status: int | None


ACKED = Sent(None)
"""A broker's acknowledgement, which has no status: one shared value (it is immutable), as
building one per message costs more than reading the acknowledgement does."""


@dataclass(frozen=True)
class Retry:
    """Try again later; `after` is the destination's Retry-After hint in seconds, if any."""

    status: int | None
    error: str
    after: float | None = None


@dataclass(frozen=True)
class Dead:
    """Permanent refusal: never resend without an operator's decision."""

    status: int | None
    error: str
    of_destination: bool = False
    """Whether it says the destination takes no delivery at all (credentials refused, an
    endpoint or a broker's exchange missing, retries spent on failures), not that this one
    message was refused (a conflict, a body or header it cannot take): the console's
    health rows count the first kind as the destination failing."""


@dataclass(frozen=True)
class Unsent:
    """Not attempted: the lease would have expired mid-attempt. Back to pending, attempt kept."""

    status: None = None
    error: str = "not attempted: the lease would have expired during the attempt"


HELD = Unsent(error="not attempted: an earlier message of its ordering key was not delivered")
"""A keyed message left out of its turn because an earlier one of its key did not end
sent or dead: pending again at once, its attempt given back (it is not claimable before
that earlier one anyway)."""

Outcome = Sent | Retry | Dead | Unsent
NO_FAILURES: Mapping[int, Retry | Dead] = MappingProxyType({})
"""A turn's failed attempts when all it attempted was delivered (or it attempted none)."""


def classify(status: int, retry_after: str | None = None, detail: str = "") -> Outcome:
    """Map an HTTP status (and Retry-After header) to an outcome."""
    if 200 <= status < 300:
        return Sent(status)
    error = truncate(f"HTTP {status}" + (f": {detail}" if detail else ""))
    if not 200 <= status < 600:
        # Not a final HTTP answer: unreadable, so worth another try rather than a verdict.
        return Retry(status, truncate(f"not a final HTTP answer: {error}"))
    if status in RETRYABLE_STATUSES or 500 <= status < 600:
        return Retry(status, error, parse_retry_after(retry_after))
    if status == 409:
        return Dead(
            status,
            truncate(
                f"HTTP 409 conflict: the destination holds this reply_id "
                f"with another body{': ' + detail if detail else ''}"
            ),
        )
    return Dead(status, error, of_destination=status in ENDPOINT_REFUSALS or status < 400)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP date); None when absent or bad."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        moment = when.timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None  # whatever the peer wrote, a hint we cannot read is no hint
    reference = now if now is not None else datetime.now(UTC).timestamp()
    return max(0.0, moment - reference)


def retry_delay(
    attempt: int, backoff: float, cap: float, hint: float | None, rng: random.Random
) -> float:
    """Delay before the next attempt: jittered backoff, or Retry-After within the cap."""
    if hint is not None and math.isfinite(hint):
        return min(cap, max(hint, backoff / 2))
    return backoff_delay(attempt, backoff, cap, rng)


def longest_retry_window(
    attempts: int, backoff: float, cap: float, timeout: float, lease: float
) -> float:
    """Worst case from the first attempt to the last resend, in seconds.

    Every wait may be a Retry-After at the cap, and every attempt may also end
    in a lease expiry before another relay takes the message over.
    """
    return (attempts - 1) * max(cap, backoff) + attempts * (timeout + lease)


RETENTION_TOLERANCE = 1e-6
"""Seconds a kept window may fall short and still count: NATS stores a duplicate window as
whole nanoseconds, and nats-py's float conversion there and back loses that much."""


def retains(kept: float, needed: float) -> bool:
    """Whether a receipt retention or duplicate window of `kept` seconds covers `needed`."""
    return kept >= needed - RETENTION_TOLERANCE


def truncate(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Keep stored errors short, on one line, and printable (a peer's body may hold a NUL)."""
    return one_line(text, limit)


Verdict = Literal["sent", "retry", "dead"]
"""What a turn did with a message, as logs and metrics name it."""


def verdict(outcome: Outcome) -> Verdict:
    """The verdict of an outcome: an unsent message is retried later."""
    if isinstance(outcome, Sent):
        return "sent"
    if isinstance(outcome, Retry | Unsent):
        return "retry"
    return "dead"


_SENT, _DEAD, _PENDING = (
    s.value for s in (MessageState.SENT, MessageState.DEAD, MessageState.PENDING)
)


def target_state(outcome: Outcome) -> str:
    """The state (a MessageState value) an outcome settles its message in."""
    if isinstance(outcome, Sent):
        return _SENT
    if isinstance(outcome, Dead):
        return _DEAD
    return _PENDING


def retry_window(
    max_attempts: int, backoff: float, backoff_cap: float, lease: float
) -> Callable[[Destination], float]:
    """The longest retry window of a destination under these settings (longest_retry_window)."""
    return lambda destination: longest_retry_window(
        max_attempts, backoff, backoff_cap, destination.timeout, lease
    )
