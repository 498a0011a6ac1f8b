"""What fault-test processes run: the CLI, an intake client, the task handler."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from outbox import AuthContext, Claim, Envelope, TaskQueue
from outbox_cli import main as cli

SENDER = "agent-a"
MAX_ATTEMPTS = 10

__all__ = ["cli", "compute", "envelope", "submit"]


def envelope(message_id: str, deadline: float) -> Envelope:
    """The task `message_id` always carries the same bytes, so a resend is a duplicate."""
    n = int(message_id.rsplit("-", 1)[-1])
    return Envelope(message_id, SENDER, {"n": n}, deadline, max_attempts=MAX_ATTEMPTS)


def submit(db_url: str, message_ids: Sequence[str], deadline: float) -> int:
    """An intake client: send each envelope until it is acknowledged (exit 0)."""
    with TaskQueue(db_url, allowed_sources=(SENDER,)) as queue:
        for message_id in message_ids:
            queue.receive(AuthContext(SENDER), envelope(message_id, deadline))
    return 0


def compute(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """The task handler: a pure function of the payload, so every retry agrees."""
    n = claim.payload["n"]
    return {"n": n, "square": n * n}
