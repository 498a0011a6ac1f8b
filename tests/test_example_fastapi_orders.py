"""The FastAPI orders example end to end: real uvicorn, worker, relay and receiver processes.

Orders are posted over HTTP while the relay runs; the relay is SIGKILLed once some
replies have reached the receiver, more orders are posted while it is down, and a new
relay takes over. Every order's event and its task reply must then be held by the
receiver exactly once, with the exact bytes the outbox stored; every order fulfilled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from support.processes import reap
from support.receiver_helpers import ROOT, free_port, wait_until

import outbox
from examples.fastapi_orders import settings
from examples.fastapi_orders.deployment import PORT_ENV, RECEIVER_PORT_ENV, Plan, prepare
from examples.fastapi_orders.processes import Stack
from outbox.intake import task_id_for

pytestmark = pytest.mark.postgresql_only

ORDERS = 100
BEFORE_THE_CRASH = 50  # posted while the relay is killed; the rest while none runs
SETTLE_WITHIN = 60.0
# uvicorn shuts down gracefully on SIGTERM, then exits by re-raising that signal.
SERVED_CLEANLY = (0, -signal.SIGTERM)


def url_of(server: sa.Engine, database: str, driver: str) -> str:
    """The admin server's URL for another database, through `driver`."""
    url = server.url.set(drivername=driver, database=database)
    return url.render_as_string(hide_password=False)


@pytest.fixture
def plan(pg_server: sa.Engine) -> Iterator[Plan]:
    """A plan on two private databases (not yet created) and two free ports."""
    name = f"orders_e2e_{uuid.uuid4().hex[:10]}"
    app_port = free_port()
    receiver_port = free_port()
    while receiver_port == app_port:
        receiver_port = free_port()
    yield Plan(
        db_url=url_of(pg_server, name, "postgresql+asyncpg"),
        receiver_db_url=url_of(pg_server, f"{name}_receiver", "postgresql+psycopg"),
        app_port=app_port,
        receiver_port=receiver_port,
    )
    with pg_server.connect() as conn:
        for database in (name, f"{name}_receiver"):
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))


class Databases:
    """Sync engines on the service's and the receiver's databases, to read what happened."""

    def __init__(self, plan: Plan) -> None:
        self.service = outbox.create_engine(plan.db_url)
        self.receiver = outbox.create_engine(plan.receiver_db_url)

    def close(self) -> None:
        """Release both pools."""
        self.service.dispose()
        self.receiver.dispose()

    def scalar(self, engine: sa.Engine, sql: str) -> Any:
        """One value."""
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()

    def received(self) -> int:
        """Receipts the receiver holds."""
        return int(self.scalar(self.receiver, "SELECT count(*) FROM receiver_receipts"))

    def progress(self) -> tuple[dict[str, int], int, int]:
        """Outbox messages by state, fulfilled orders, and receipts held."""
        states = dict(
            self.rows(self.service, "SELECT state, count(*) FROM outbox_messages GROUP BY state")
        )
        fulfilled = self.scalar(
            self.service, "SELECT count(*) FROM orders WHERE status = 'fulfilled'"
        )
        return states, int(fulfilled), self.received()

    def settled(self, orders: int) -> bool:
        """Every order fulfilled and both its messages sent and received; fails on a dead one."""
        progress = self.progress()
        assert "dead" not in progress[0], progress
        return progress == ({"sent": 2 * orders}, orders, 2 * orders)

    def rows(self, engine: sa.Engine, sql: str) -> list[Any]:
        """Every row of a query."""
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql)))


@pytest.fixture
def databases(plan: Plan) -> Iterator[Databases]:
    """The plan's databases, created and upgraded by the example's own preparation."""
    prepare(plan)
    opened = Databases(plan)
    yield opened
    opened.close()


def order_of(n: int) -> dict[str, Any]:
    """The n-th order posted: non-ASCII items, so exact bytes are compared, not just ASCII."""
    return {"item": f"thé-{n}-книга", "quantity": n % 7 + 1}


def post_orders(plan: Plan, numbers: range) -> dict[int, dict[str, Any]]:
    """POST each order, 20 at a time; order id -> what was posted."""

    async def post_all() -> dict[int, dict[str, Any]]:
        gate = asyncio.Semaphore(20)
        async with httpx.AsyncClient(base_url=plan.app_base, timeout=30) as client:

            async def post(n: int) -> tuple[int, dict[str, Any]]:
                async with gate:
                    answer = await client.post("/orders", json=order_of(n))
                assert answer.status_code == 201, answer.text
                return int(answer.json()["id"]), order_of(n)

            return dict(await asyncio.gather(*(post(n) for n in numbers)))

    return asyncio.run(post_all())


def running(stack: Stack, logs: Path) -> bool:
    """True while every process runs; fails with the log of one that exited."""
    gone = stack.exited()
    if gone is not None:
        log = (logs / f"{gone}.log").read_text(errors="replace")[-4000:]
        raise AssertionError(f"{gone} exited with {stack.processes[gone].returncode}:\n{log}")
    return True


def test_every_order_reaches_the_receiver_once_with_its_exact_body_across_a_relay_crash(
    plan: Plan, databases: Databases, tmp_path: Path
) -> None:
    with Stack(plan, logs=tmp_path) as stack:
        with ThreadPoolExecutor(1) as poster:
            first = poster.submit(post_orders, plan, range(BEFORE_THE_CRASH))
            # Killed while orders are still coming in and replies still going out.
            wait_until(
                lambda: running(stack, tmp_path) and databases.received() >= 5,
                SETTLE_WITHIN,
                "some replies to reach the receiver",
            )
            stack.kill("relay")
            posted = first.result()
        assert 0 < databases.received() < 2 * ORDERS  # mid-way: some, not all
        posted |= post_orders(plan, range(BEFORE_THE_CRASH, ORDERS))  # the outbox keeps them
        stack.start("relay")  # a new owner: it takes over the dead relay's leases
        try:
            wait_until(
                lambda: running(stack, tmp_path) and databases.settled(ORDERS),
                SETTLE_WITHIN,
                "every order to be fulfilled and every message sent",
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; (messages, fulfilled, receipts) {databases.progress()}"
            ) from exc
    assert stack.exit_codes["relay"] == 0
    assert stack.exit_codes["worker"] == 0
    assert stack.exit_codes["app"] in SERVED_CLEANLY
    assert stack.exit_codes["receiver"] in SERVED_CLEANLY

    task_reply = {
        order_id: "reply:" + task_id_for(settings.SOURCE, f"order-{order_id}:fulfil")
        for order_id in posted
    }
    created = {order_id: f"order-{order_id}:created" for order_id in posted}
    sent = {
        row.reply_id: (bytes(row.body), row.content_hash)
        for row in databases.rows(
            databases.service, "SELECT reply_id, body, content_hash FROM outbox_messages"
        )
    }
    held = {
        row.reply_id: (bytes(row.body), row.content_hash)
        for row in databases.rows(
            databases.receiver, "SELECT reply_id, body, content_hash FROM receiver_receipts"
        )
    }
    assert len(posted) == ORDERS
    assert set(held) == set(created.values()) | set(task_reply.values())
    assert held == sent  # each with the exact bytes, and hash, the outbox stored
    effects = databases.rows(
        databases.receiver, "SELECT reply_id, count(*) FROM receiver_effects GROUP BY reply_id"
    )
    assert dict(effects) == dict.fromkeys(held, 1)  # applied exactly once each
    for order_id, order in posted.items():
        assert json.loads(held[created[order_id]][0]) == {"order_id": order_id, **order}
        reply = json.loads(held[task_reply[order_id]][0])
        assert (reply["status"], reply["result"]) == (
            "done",
            {"order_id": order_id, "status": "fulfilled"},
        )
    statuses = databases.rows(databases.service, "SELECT status, count(*) FROM orders GROUP BY 1")
    assert dict(statuses) == {"fulfilled": ORDERS}
    tasks = databases.rows(databases.service, "SELECT state, count(*) FROM outbox_tasks GROUP BY 1")
    assert dict(tasks) == {"done": ORDERS}


def test_one_command_runs_the_stack_and_stops_it_on_sigterm(plan: Plan, tmp_path: Path) -> None:
    variables = {
        settings.DB_ENV: plan.db_url,
        settings.RECEIVER_DB_ENV: plan.receiver_db_url,
        PORT_ENV: str(plan.app_port),
        RECEIVER_PORT_ENV: str(plan.receiver_port),
    }
    output = tmp_path / "launcher.out"

    def ready() -> bool:
        said = output.read_text(errors="replace")
        assert launcher.poll() is None, f"the launcher exited with {launcher.returncode}:\n{said}"
        return "Ctrl-C stops them all." in said

    with output.open("wb") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "examples.fastapi_orders"],
            cwd=ROOT,
            env={**os.environ, **variables},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(ready, SETTLE_WITHIN, "the launcher to start every process")
        [(order_id, _)] = post_orders(plan, range(1)).items()
        databases = Databases(plan)  # created by the launcher
        try:
            wait_until(lambda: ready() and databases.settled(1), SETTLE_WITHIN, "the order")
        finally:
            databases.close()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=SETTLE_WITHIN) == 0
    finally:
        # On a failure, SIGTERM first: the launcher then stops the processes it started,
        # each in a session of its own, which a SIGKILL of the launcher would orphan.
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=SETTLE_WITHIN)
        reap(launcher)
    said = output.read_text(errors="replace")
    assert order_id == 1
    assert re.search(r"stopped: app -?\d+, worker 0, relay 0, receiver -?\d+", said), said
    children = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", said)]
    assert len(children) == 4, said
    for pid in children:  # each reaped by the launcher
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
