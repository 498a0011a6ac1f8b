"""BodyBudget in-process: what a request reserves, the refusal, and the release."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.types import Message, Receive, Scope, Send
from support.receiver_helpers import SECRET

from receiver import ReceiptStore, upgrade
from receiver.app import create_app
from receiver.budget import BodyBudget

MAX_BODY = 1000


def scope(*headers: tuple[bytes, bytes]) -> Scope:
    """An HTTP POST scope with these headers."""
    return {"type": "http", "method": "POST", "path": "/replies", "headers": list(headers)}


async def call(budget: BodyBudget, request: Scope) -> list[Message]:
    """The messages the middleware sends for `request`."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await budget(request, receive, send)
    return sent


class Holding:
    """An app that records the budget in use while it runs, then raises if told to."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[int] = []
        self.budget: BodyBudget | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.budget is not None
        self.seen.append(self.budget.in_use)
        if self.fail:
            raise RuntimeError("the app failed")


def budget_around(app: Holding, budget: int = 2500) -> BodyBudget:
    """A BodyBudget wrapping `app`, which can see it."""
    middleware = BodyBudget(app, budget=budget, max_body=MAX_BODY)
    app.budget = middleware
    return middleware


@pytest.mark.parametrize(
    ("headers", "reserved"),
    [
        (((b"content-length", b"700"),), 700),
        (((b"transfer-encoding", b"chunked"),), MAX_BODY),  # undeclared: the worst case
        (((b"content-length", b"5000"),), 0),  # the app refuses it (413) unread
        (((b"content-length", b"-1"),), 0),  # the app refuses it (400) unread
        ((), 0),
    ],
)
def test_a_request_reserves_what_its_body_may_take(
    headers: tuple[tuple[bytes, bytes], ...], reserved: int
) -> None:
    app = Holding()
    middleware = budget_around(app)
    asyncio.run(call(middleware, scope(*headers)))
    assert app.seen == [reserved]
    assert middleware.in_use == 0


def test_over_the_budget_is_503_with_retry_after_and_unread() -> None:
    app = Holding()
    middleware = budget_around(app)
    middleware.in_use = 2000  # held by requests still reading
    sent = asyncio.run(call(middleware, scope((b"content-length", b"600"))))
    assert app.seen == []
    start = sent[0]
    assert start["status"] == 503
    assert dict(start["headers"])[b"retry-after"] == b"1"
    assert middleware.in_use == 2000
    # What still fits is let through.
    asyncio.run(call(middleware, scope((b"content-length", b"500"))))
    assert app.seen == [2500]


def test_the_reservation_is_returned_when_the_app_fails() -> None:
    middleware = budget_around(Holding(fail=True))
    with pytest.raises(RuntimeError):
        asyncio.run(call(middleware, scope((b"content-length", b"900"))))
    assert middleware.in_use == 0


def test_a_budget_below_max_body_is_refused_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'receiver.db'}"
    upgrade(url)
    with ReceiptStore(url) as store, pytest.raises(ValueError, match="body_budget"):
        create_app(store, [SECRET], max_body=2000, body_budget=1999)
