"""Every before-commit failpoint fires after its statements ran and before their COMMIT.

For each path that commits work, on both backends: the failpoint is armed, and
at its arrival another connection sees the transaction open with its writes
(PostgreSQL: RowExclusiveLock on the tables the step writes, held by a
transaction `idle in transaction`; SQLite: the write lock taken). After Crash
nothing of the step is there: it rolled back. This holds on the paths that
commit one statement in autocommit too (a claim, a batch of results, a relay's
settle, a receipt with the reference effect on PostgreSQL): an armed failpoint
runs that statement in a transaction. Real processes killed in these windows:
tests/faults/test_crash_matrix.py and tests/faults/test_broker_crashes.py; the
worker's statements on held connections: tests/test_worker_statements.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from support.commit_windows import Look, looking
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import ScriptedServer

from outbox import AuthContext, Envelope, TaskQueue, failpoints
from outbox.testing import ManualClock
from receiver import ReceiptStore
from receiver.effects import record_effect
from relay import Relay, make_destination

A = AuthContext("agent-a")
COMMIT_WINDOWS = {point for point in failpoints.POINTS if "before_" in point and "commit" in point}


def receive(queue: TaskQueue, clock: ManualClock, name: str = "m-1") -> str:
    """One task, committed; its id."""
    return queue.receive(A, Envelope(name, "agent-a", {"n": 1}, clock() + 3600)).task_id


def count(engine: sa.Engine, table: str) -> int:
    """Rows in `table`."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def crash_looking(engine: sa.Engine, point: str, step: Callable[[], object]) -> Look:
    """Run `step` with `point` armed; the one look taken there before the crash."""
    with looking(engine, point) as seen, pytest.raises(failpoints.Crash):
        step()
    [taken] = seen
    return taken


def assert_held(found: Look, backend: str, tables: set[str]) -> None:
    """The transaction was open with its writes: these tables (PostgreSQL, MySQL), the lock
    (SQLite)."""
    assert found.write_locked
    if backend != "sqlite":
        assert tables <= found.written, found


def test_the_commit_windows_are_these() -> None:
    assert {
        "intake.before_commit",
        "claim.before_commit",
        "finish.before_commit",
        "relay.before_sent_commit",
        "receiver.before_commit",
    } == COMMIT_WINDOWS


def test_intake(queue: TaskQueue, clock: ManualClock, backend: str) -> None:
    found = crash_looking(queue.engine, "intake.before_commit", lambda: receive(queue, clock))
    assert_held(found, backend, {"outbox_inbox", "outbox_tasks"})
    assert (count(queue.engine, "outbox_inbox"), count(queue.engine, "outbox_tasks")) == (0, 0)


@pytest.mark.parametrize("reconcile", [False, True], ids=["one statement", "reconciling"])
def test_claim(queue: TaskQueue, clock: ManualClock, backend: str, reconcile: bool) -> None:
    task_id = receive(queue, clock)
    found = crash_looking(
        queue.engine,
        "claim.before_commit",
        lambda: queue.claim_many("w", 5, reconcile=reconcile),
    )
    assert_held(found, backend, {"outbox_tasks"})
    assert queue.task(task_id)["state"] == "pending"  # type: ignore[index]


@pytest.mark.parametrize("many", [True, False], ids=["finish_many", "finish"])
def test_finish(queue: TaskQueue, clock: ManualClock, backend: str, many: bool) -> None:
    receive(queue, clock)
    claim = queue.claim("w")
    assert claim is not None

    def step() -> None:
        if many:
            queue.finish_many([(claim, "ok")])
        else:
            queue.finish(claim, "ok")

    found = crash_looking(queue.engine, "finish.before_commit", step)
    assert_held(found, backend, {"outbox_tasks", "outbox_messages"})
    assert queue.task(claim.task_id)["state"] == "running"  # type: ignore[index]
    assert queue.messages() == []


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A peer answering 200."""
    with ScriptedServer() as running:
        yield running


def test_relay_settle(
    db_url: str, clock: ManualClock, backend: str, server: ScriptedServer
) -> None:
    queue = TaskQueue(db_url, clock=clock)
    publish_many(queue.engine, ["r-1"], clock=clock)
    destination = make_destination(server.url, secret=SECRET, timeout=5)
    try:
        with Relay(db_url, {"default": destination}, clock=clock) as relay:
            found = crash_looking(queue.engine, "relay.before_sent_commit", relay.dispatch_once)
        assert_held(found, backend, {"outbox_messages"})
        assert rows(queue.engine)["r-1"]["state"] == "sending"
    finally:
        queue.close()


@pytest.mark.parametrize("effect", [record_effect, None], ids=["reference effect", "no effect"])
def test_receipt(db_url: str, clock: ManualClock, backend: str, effect: object) -> None:
    store = ReceiptStore(db_url, clock=clock)
    try:
        found = crash_looking(
            store.engine,
            "receiver.before_commit",
            lambda: store.accept("r-1", b"{}", effect),  # type: ignore[arg-type]
        )
        written = {"receiver_receipts"} | ({"receiver_effects"} if effect else set())
        assert_held(found, backend, written)
        assert store.lookup("r-1") is None
        assert count(store.engine, "receiver_effects") == 0
    finally:
        store.close()
