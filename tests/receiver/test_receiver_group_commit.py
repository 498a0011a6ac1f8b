"""Single replies that arrive together share one transaction, each with its own answer."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from support.receiver_helpers import SECRET, count_effects, signed

from receiver import ReceiptStore, create_app
from receiver.effects import Effect, record_effect
from receiver.rules import ReceiverRules

NOW = 1_700_000_000


def test_replies_that_arrive_during_a_commit_share_the_next_one(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ReceiptStore(db_url)
    groups: list[list[str]] = []
    release = threading.Event()
    real_accept_many = store.accept_many

    def recording(
        items: Sequence[tuple[str, bytes]], effect: Effect | None = None, *, isolate: bool = False
    ) -> list[str]:
        groups.append([reply_id for reply_id, _ in items])
        if len(groups) == 1:
            release.wait(10)  # hold the first commit open while the others arrive
        return real_accept_many(items, effect, isolate=isolate)

    monkeypatch.setattr(store, "accept_many", recording)
    checked: list[str] = []
    real_check = ReceiverRules.check_message

    def counting(self: ReceiverRules, headers: Any, body: bytes) -> Any:
        result = real_check(self, headers, body)
        checked.append("checked")  # queued for storing right after this returns
        return result

    monkeypatch.setattr(ReceiverRules, "check_message", counting)
    app = create_app(store, [SECRET], wall_clock=lambda: NOW, effect=record_effect)
    later = [
        ("r-1", b'{"n":1}'),
        ("r-2", b'{"n":2}'),
        ("r-1", b'{"n":1}'),  # the same reply again: a duplicate
        ("r-2", b'{"n":"other"}'),  # the same id with another body: a conflict
    ]

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as client:

            async def post(reply_id: str, body: bytes) -> httpx.Response:
                headers = signed(reply_id, body, SECRET, NOW)
                return await client.post("/replies", content=body, headers=headers)

            first = asyncio.ensure_future(post("r-0", b'{"n":0}'))
            await _until(lambda: len(groups) == 1)
            rest = [asyncio.ensure_future(post(r, b)) for r, b in later]
            await _until(lambda: len(checked) == 1 + len(later))
            release.set()
            return [await first, *[await task for task in rest]]

    try:
        answers = asyncio.run(scenario())
    finally:
        release.set()
        store.close()
    assert groups[0] == ["r-0"]
    # One transaction for all four that arrived while the first commit was open.
    assert [sorted(group) for group in groups[1:]] == [sorted(r for r, _ in later)]
    # Each keeps its own outcome, as if stored alone in arrival order.
    outcomes = sorted(
        (reply_id, a.status_code, a.json().get("duplicate"))
        for (reply_id, _), a in zip([("r-0", b""), *later], answers, strict=True)
    )
    assert outcomes == [
        ("r-0", 200, False),
        ("r-1", 200, False),
        ("r-1", 200, True),
        ("r-2", 200, False),
        ("r-2", 409, None),
    ]
    assert [count_effects(db_url, r) for r in ("r-0", "r-1", "r-2")] == [1, 1, 1]


async def _until(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.001)
