"""PostgreSQL's batch of results against a renewal of the same task committed meanwhile.

The batch finds each task by a primary-key probe and updates that row version by
ctid (outbox.drivers.postgresql.task_results). A renewal that commits while the batch
waits for the row's lock leaves it a newer version: the task is still held, so its
result must still be written, by the pool's statements and by the worker's held
connection alike.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from support.driver_helpers import START
from support.task_rows import task_values

from outbox.drivers import Driver
from outbox.drivers.task_interface import Completion
from outbox.schema import messages, tasks

COMPLETION: Completion = ("t", "w", 1, '"r"')
REPLY = {
    "reply_id": "reply:t",
    "task_id": "t",
    "destination": "replies",
    "ordering_key": None,
    "body": b"{}",
    "content_hash": "h",
    "headers": "{}",
}


def waiting_for_a_lock(engine: sa.Engine) -> bool:
    """Whether a session of the test's database waits for a lock."""
    with engine.connect() as conn:
        query = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(conn.exec_driver_sql(query).scalar_one())


def completed_behind_a_renewal(
    driver: Driver, engine: sa.Engine, complete: Callable[[], set[str]]
) -> set[str]:
    """Run `complete` on a thread while a renewal of the task holds its row, commit the
    renewal once `complete` waits for it; what `complete` returned."""
    with engine.begin() as conn:
        held = {"state": "running", "owner": "w", "fence": 1, "lease_until": START + 30}
        driver.insert_task(conn, task_values("t", **held))
    outcome: dict[str, set[str]] = {}
    with engine.connect() as renewal:
        renewal.begin()
        assert driver.renew_leases(renewal, [("t", "w", 1)], 30.0, START + 5)
        thread = threading.Thread(target=lambda: outcome.update(done=complete()))
        thread.start()
        deadline = time.monotonic() + 30
        pause = threading.Event()
        while not waiting_for_a_lock(engine):
            assert time.monotonic() < deadline, "the batch never waited for the renewal"
            assert thread.is_alive(), "the batch ran without waiting for the renewal"
            pause.wait(0.01)
        renewal.commit()
    thread.join(30)
    assert not thread.is_alive()
    return outcome["done"]


def stored(engine: sa.Engine) -> tuple[str, list[str]]:
    """The task's state, and the reply_ids stored."""
    with engine.connect() as conn:
        state = conn.execute(sa.select(tasks.c.state)).scalar_one()
        return state, list(conn.execute(sa.select(messages.c.reply_id)).scalars())


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_pools_batch_writes_a_result_renewed_meanwhile(
    driver: Driver, engine: sa.Engine
) -> None:
    def complete() -> set[str]:
        with engine.begin() as conn:
            return driver.complete_tasks(conn, [COMPLETION], [REPLY], START + 10)

    assert completed_behind_a_renewal(driver, engine, complete) == {"t"}
    assert stored(engine) == ("done", ["reply:t"])


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_held_batch_writes_a_result_renewed_meanwhile(
    driver: Driver, engine: sa.Engine
) -> None:
    finishes = driver.held_task_finishes(engine, owns_engine=True)
    assert finishes is not None

    async def complete_and_close() -> set[str]:
        try:
            return await finishes.complete_tasks([COMPLETION], [REPLY], START + 10, "x")
        finally:
            await finishes.close()

    done = completed_behind_a_renewal(driver, engine, lambda: asyncio.run(complete_and_close()))
    assert done == {"t"}
    assert stored(engine) == ("done", ["reply:t"])
