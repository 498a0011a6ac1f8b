"""Handlers for `outbox worker` run as a real process in tests."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

from outbox import Claim


def double(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """Doubles payload["n"]."""
    return {"n": claim.payload["n"] * 2}


def gated(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """Marks that it started, then holds until the release file exists (test-controlled)."""
    deadline = _mark_started(claim)
    while not _released(deadline):
        stop.wait(0.01)
    return {"n": claim.payload["n"]}


def _mark_started(claim: Claim) -> float:
    """Touch the task's started-file in the gate folder; the deadline for its release."""
    (Path(os.environ["OUTBOXDEV_TEST_GATE"]) / f"started-{claim.task_id}").touch()
    return time.monotonic() + 30


def _released(deadline: float) -> bool:
    """Whether the release file exists; TimeoutError once `deadline` has passed."""
    if (Path(os.environ["OUTBOXDEV_TEST_GATE"]) / "release").exists():
        return True
    if time.monotonic() > deadline:
        raise TimeoutError("never released")
    return False


def double_or_fail(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """Doubles payload["n"]; an odd n fails the attempt with an error."""
    if claim.payload["n"] % 2:
        raise RuntimeError(f"odd input {claim.payload['n']}")
    return {"n": claim.payload["n"] * 2}


async def async_gated(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
    """`gated`, as an async handler: awaits the release file without blocking its loop."""
    deadline = _mark_started(claim)
    while not _released(deadline):
        await asyncio.sleep(0.01)
    return {"n": claim.payload["n"]}


async def _triple(claim: Claim, stop: asyncio.Event) -> dict[str, Any]:
    return {"n": claim.payload["n"] * 3}


@functools.wraps(_triple)
def wrapped_async(claim: Claim, stop: asyncio.Event) -> Any:
    """A plain wrapper around an async function, as a careless decorator makes one."""
    return _triple(claim, stop)
