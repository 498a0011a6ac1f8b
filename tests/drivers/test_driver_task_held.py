"""Conformance: the worker's held connections (claims and batches of results on the event
loop) where a backend has them, and the database errors its client raises, on every
driver."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from support.driver_helpers import START
from support.task_rows import task_values

from outbox.drivers import Driver
from outbox.schema import messages, tasks


def test_the_database_errors_are_those_its_client_raises(driver: Driver, engine: sa.Engine) -> None:
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as raised:
        conn.exec_driver_sql("SELECT * FROM no_such_table")
    assert isinstance(raised.value.orig, driver.database_errors)


def test_held_connections_are_for_the_toolkits_own_engines(
    driver: Driver, engine: sa.Engine
) -> None:
    claims = driver.held_task_claims(engine, owns_engine=True)
    finishes = driver.held_task_finishes(engine, owns_engine=True)
    # A caller's engine may keep its connection settings outside its URL.
    assert driver.held_task_claims(engine, owns_engine=False) is None
    assert driver.held_task_finishes(engine, owns_engine=False) is None
    # SQLite's one writer, and MySQL's pool of PyMySQL connections (no asyncio client of
    # the toolkit's): their claims and batches go through the pool.
    if driver.name in ("sqlite", "mysql"):
        assert (claims, finishes) == (None, None)
    else:
        assert claims is not None
        assert finishes is not None


def test_held_claims_and_batches_lease_and_finish_as_the_pools(
    driver: Driver, engine: sa.Engine
) -> None:
    claims = driver.held_task_claims(engine, owns_engine=True)
    finishes = driver.held_task_finishes(engine, owns_engine=True)
    if claims is None or finishes is None:
        # The test above holds which backends have none; a backend holds both or neither.
        assert (claims, finishes) == (None, None)
        return
    with engine.begin() as conn:
        for n, (task_id, priority) in enumerate((("low", 0), ("high", 5), ("third", 0))):
            driver.insert_task(conn, task_values(task_id, priority=priority, created_at=START + n))

    async def claim_and_finish() -> tuple[list[str], set[str]]:
        try:
            now = START + 10
            rows = await claims.claim_tasks(owner="w", now=now, lease=30.0, limit=2, window="x")
            leased = [(row["task_id"], row["owner"], row["fence"]) for row in rows]
            completions = [(*held, f'"{held[0]}"') for held in leased]
            completions.append(("third", "w", 1, '"not held"'))
            replies = [
                {"reply_id": f"r:{c[0]}", "task_id": c[0], "destination": "d", "body": b"{}"}
                | {"content_hash": "h", "headers": "{}"}
                for c in completions
            ]
            done = await finishes.complete_tasks(completions, replies, now, "y")
            empty = await claims.claim_tasks(owner="w", now=now, lease=30.0, limit=0, window="x")
            assert empty == []
            return [row["task_id"] for row in rows], done
        finally:
            await claims.close()
            await finishes.close()

    claimed, done = asyncio.run(claim_and_finish())
    assert claimed == ["high", "low"]  # in claim order
    assert done == {"high", "low"}
    with engine.connect() as conn:
        states = dict(conn.execute(sa.select(tasks.c.task_id, tasks.c.state)).all())
        replied = set(conn.execute(sa.select(messages.c.task_id)).scalars())
    assert states == {"high": "done", "low": "done", "third": "pending"}
    assert replied == {"high", "low"}

    async def after_close() -> None:
        await claims.claim_tasks(owner="w", now=START, lease=30.0, limit=1, window="x")

    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(after_close())
