"""The dead list's filters as the console's forms give them: parsed as `outbox dead list`
parses its flags, a bad one named (400) before any query runs."""

from __future__ import annotations

from outbox.dead_filter import DeadFilter
from outbox.redaction import shown_value
from outbox_cli.arguments import non_empty, parse_duration, positive_int

FILTERS = ("destination", "status", "error", "since", "until")
LARGEST_STATUS = 2**31 - 1
"""The largest status the database's column holds: a larger one is a bad filter (400),
not a query the database refuses (500)."""
LARGEST_ID = 2**63 - 1
"""The largest message id (a bigint)."""


def dead_filter(given: dict[str, str]) -> DeadFilter:
    """The `dead list` filter the page's fields name; ValueError names a bad one."""
    return DeadFilter(
        destination=non_empty(given["destination"]) if given["destination"].strip() else None,
        status=status_filter(given["status"]) if given["status"].strip() else None,
        error=given["error"] if given["error"].strip() else None,
        newer_than=duration_filter("since", given["since"]),
        older_than=duration_filter("until", given["until"]),
    )


def duration_filter(name: str, given: str) -> float | None:
    """A duration filter's seconds (None when blank); ValueError if not a duration."""
    if not given.strip():
        return None
    try:
        return parse_duration(given)
    except OverflowError:
        # Digits enough to pass the pattern, too many for a float.
        raise ValueError(f"{name}: too long a duration") from None


def status_filter(given: str) -> int:
    """A status to filter on: a whole number from 1 to LARGEST_STATUS; ValueError if not."""
    status = positive_int(given)
    if status > LARGEST_STATUS:
        raise ValueError(f"status: at most {LARGEST_STATUS}")
    return status


def page_start(given: str) -> int | None:
    """The message id a next page starts after (None: the first page); ValueError if not one."""
    if not given.strip():
        return None
    try:
        start = int(given)
    except ValueError:
        start = -1
    if not 0 <= start <= LARGEST_ID:
        raise ValueError(f"after: not a message id: {shown_value(given)}")
    return start
