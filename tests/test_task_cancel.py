"""`outbox task cancel` and Operations.cancel_task: an operator's cancel, its reply written
as a worker's would be, and its audit; the console's cancel is tested with its pages."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from support.driver_helpers import add_task
from support.operations_helpers import run_json

import outbox
from outbox.errors import TaskNotCancelled
from outbox.operations import Operations
from outbox.schema import messages, task_decisions, tasks
from outbox.testing import ManualClock
from outbox_cli import main


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database, with a pending, a running and a done task."""
    created = outbox.create_engine(db_url)
    with created.begin() as conn:
        add_task(conn, "t-pending", "pending", 1000.0)
        add_task(conn, "t-running", "running", 1000.0)
        add_task(conn, "t-done", "done", 1000.0)
    yield created
    created.dispose()


def task_state(engine: sa.Engine, task_id: str) -> str:
    """One task's state."""
    with engine.connect() as conn:
        query = sa.select(tasks.c.state).where(tasks.c.task_id == task_id)
        return str(conn.execute(query).scalar_one())


def replies(engine: sa.Engine) -> list[tuple[str | None, str, dict[str, object]]]:
    """Every message's task_id, destination and body."""
    with engine.connect() as conn:
        query = sa.select(messages.c.task_id, messages.c.destination, messages.c.body)
        return [(t, d, json.loads(bytes(b))) for t, d, b in conn.execute(query)]


def decisions(engine: sa.Engine) -> list[dict[str, object]]:
    """Every audited task decision, oldest first."""
    with engine.connect() as conn:
        query = sa.select(task_decisions).order_by(task_decisions.c.id)
        return [dict(row) for row in conn.execute(query).mappings()]


@pytest.mark.parametrize("task_id", ["t-pending", "t-running"])
def test_a_cancel_ends_the_task_with_its_reply_and_an_audit_row(
    db_url: str, engine: sa.Engine, clock: ManualClock, task_id: str
) -> None:
    with Operations(db_url, clock=clock) as ops:
        audit = ops.cancel_task(
            task_id, reason="customer withdrew", by="anna", reply_destination="orders"
        )
    with engine.connect() as conn:
        assert ops.driver.task_decisions(conn, task_id) == [audit]
    assert task_state(engine, task_id) == "cancelled"
    assert audit == {
        "id": audit["id"],
        "task_id": task_id,
        "action": "cancel",
        "requested_by": "anna",
        "reason": "customer withdrew",
        "requested_at": clock(),
    }
    [(replied, destination, body)] = replies(engine)
    assert (replied, destination) == (task_id, "orders")
    assert body["status"] == "cancelled"
    assert body["error"] == {"code": "cancelled", "reason": "customer withdrew"}


@pytest.mark.parametrize(("task_id", "state"), [("t-done", "done"), ("nobody", None)])
def test_a_final_or_missing_task_is_refused_and_nothing_written(
    db_url: str, engine: sa.Engine, task_id: str, state: str | None
) -> None:
    with Operations(db_url) as ops, pytest.raises(TaskNotCancelled) as refused:
        ops.cancel_task(task_id, reason="r", by="anna")
    assert (refused.value.task_id, refused.value.state) == (task_id, state)
    assert replies(engine) == []
    assert decisions(engine) == []


def test_a_cancel_needs_a_reason_and_an_operator(db_url: str, engine: sa.Engine) -> None:
    with Operations(db_url) as ops:
        for reason, by, said in [(" ", "anna", "a reason"), ("why", "", "who decides")]:
            with pytest.raises(ValueError, match=said):
                ops.cancel_task("t-pending", reason=reason, by=by)
    assert task_state(engine, "t-pending") == "pending"


def test_the_command_cancels_audits_and_refuses_a_final_task(
    db_url: str, engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["task", "cancel", "t-pending", "--db", db_url, "--reason", "duplicate order"]
    audit = run_json(capsys, *argv, "--by", "anna", "--reply-destination", "orders")
    assert isinstance(audit, dict)
    assert (audit["task_id"], audit["requested_by"]) == ("t-pending", "anna")
    assert [(t, d) for t, d, _ in replies(engine)] == [("t-pending", "orders")]
    assert main(["task", "cancel", "t-done", "--db", db_url, "--reason", "r", "--by", "a"]) == 1
    said = capsys.readouterr()
    assert said.err == "outbox: not cancelled: task is done (final), not cancelled: 't-done'\n"
    assert len(decisions(engine)) == 1
