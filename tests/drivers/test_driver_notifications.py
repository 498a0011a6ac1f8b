"""Notifications: a listener that wakes on its channel where the backend has them, none
where it has not (the caller polls alone)."""

from __future__ import annotations

import asyncio
import threading
import uuid

import sqlalchemy as sa

from outbox.drivers import Driver

DEADLINE = 10.0
NOTIFYING = {"postgresql"}
"""The backends whose drivers hand out a listener."""


def test_a_backend_without_notifications_hands_out_no_listener(
    driver: Driver, engine: sa.Engine, backend: str
) -> None:
    listener = driver.listener(engine, "outbox_test", 0.1, threading.Event())
    assert (listener is not None) == (backend in NOTIFYING)


def test_a_listener_calls_on_connect_and_on_each_notification(
    driver: Driver, engine: sa.Engine, backend: str
) -> None:
    if backend not in NOTIFYING:
        return
    channel = f"outbox_test_{uuid.uuid4().hex}"
    listening = threading.Event()

    async def heard_after_notify() -> int:
        calls = asyncio.Queue[None]()
        listener = driver.listener(
            engine, channel, 0.1, listening, on_notify=lambda: calls.put_nowait(None)
        )
        assert listener is not None
        task = asyncio.ensure_future(listener.keep_listening())
        try:
            await asyncio.wait_for(calls.get(), DEADLINE)  # the (re)connection's call
            assert listening.is_set()
            await asyncio.to_thread(notify, engine, channel)
            await asyncio.wait_for(calls.get(), DEADLINE)
            return calls.qsize()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(heard_after_notify()) == 0
    assert not listening.is_set(), "still marked listening after it stopped"


def test_a_listener_without_a_callback_wakes_a_wait(
    driver: Driver, engine: sa.Engine, backend: str
) -> None:
    if backend not in NOTIFYING:
        return
    channel = f"outbox_test_{uuid.uuid4().hex}"
    listening = threading.Event()

    async def woken() -> bool:
        listener = driver.listener(engine, channel, 0.1, listening)
        assert listener is not None
        task = asyncio.ensure_future(listener.keep_listening())
        try:
            assert await asyncio.to_thread(listening.wait, DEADLINE), "never listened"
            await listener.clear()
            await asyncio.to_thread(notify, engine, channel)
            started = asyncio.get_running_loop().time()
            await listener.wait(DEADLINE)
            return asyncio.get_running_loop().time() - started < DEADLINE
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(woken()), "the notification did not end the wait"


def notify(engine: sa.Engine, channel: str) -> None:
    """Send one notification on `channel`, committed."""
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_notify(:channel, '')"), {"channel": channel})
