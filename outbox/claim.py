"""Claim: a leased task, as the claim statements return it.

Its own module because both sides of a lease need it: TaskQueue (outbox.tasks)
hands claims out and outbox.task_results writes their results.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Claim:
    """A leased task: who holds it, under which fence, and what to do."""

    task_id: str
    owner: str
    fence: int
    attempt: int
    payload: dict[str, Any]
    lease_until: float | None = None
    deadline: float | None = None
    creation: Mapping[str, str] | None = field(default=None, compare=False)
    """The trace context the task was received in (traceparent, tracestate), if any."""


def claims_from_rows(rows: Sequence[Mapping[Any, Any]]) -> list[Claim]:
    """The Claims of a claim statement's rows, in claim order (RETURNING keeps none)."""
    ordered = sorted(rows, key=lambda r: (-r["priority"], r["available_at"], r["created_at"]))
    return [
        Claim(
            task_id=r["task_id"],
            owner=r["owner"],
            fence=r["fence"],
            attempt=r["attempts"],
            payload=json.loads(r["payload"]),
            lease_until=r["lease_until"],
            deadline=r["deadline"],
            creation=_creation(r["traceparent"], r["tracestate"]),
        )
        for r in ordered
    ]


def _creation(traceparent: str | None, tracestate: str | None) -> Mapping[str, str] | None:
    """A claimed task's creation context, from its columns (most tasks have none)."""
    if traceparent is None:
        return None
    if tracestate is None:
        return {"traceparent": traceparent}
    return {"traceparent": traceparent, "tracestate": tracestate}
