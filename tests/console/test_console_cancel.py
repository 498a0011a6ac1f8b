"""The console's cancel of a task: Operations.cancel_task, as `outbox task cancel` takes it,
under the operator the console knows, its reply sent where the worker's go."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import sqlalchemy as sa
from support.console_helpers import OPERATOR, ConsoleClient

from outbox.operations import Operations
from outbox.schema import messages, task_decisions, tasks
from outbox_cli.console.actions import NO_REASON
from outbox_cli.console.forms import CSRF_COOKIE

Client = Callable[..., ConsoleClient]


def task_ids(engine: sa.Engine, state: str) -> list[str]:
    """The seeded tasks in `state`."""
    with engine.connect() as conn:
        query = sa.select(tasks.c.task_id).where(tasks.c.state == state).order_by(tasks.c.task_id)
        return list(conn.execute(query).scalars())


def decisions(engine: sa.Engine) -> list[dict[str, object]]:
    """Every audited task decision, oldest first."""
    with engine.connect() as conn:
        query = sa.select(task_decisions).order_by(task_decisions.c.id)
        return [dict(row) for row in conn.execute(query).mappings()]


def cancel(console: ConsoleClient, task_id: str, **fields: str) -> httpx.Response:
    """POST the cancel form of a task's page, after loading it as the browser would."""
    console.get(f"/task?id={task_id}")
    form = {"csrf_token": console.cookies[CSRF_COOKIE], "task_id": task_id, **fields}
    return console.post("/task/cancel", data=form)


def test_a_pending_task_is_cancelled_with_its_reply_and_audited_under_the_operator(
    ops: Operations, make_client: Client, engine: sa.Engine
) -> None:
    task_id = task_ids(engine, "pending")[0]
    console = make_client(operator=OPERATOR, reply_destination="orders")
    page = console.get(f"/task?id={task_id}").text
    assert 'id="cancel-form"' in page
    assert f"cancel as {OPERATOR}" in page
    assert "<code>orders</code>" in page
    done = cancel(console, task_id, reason="customer withdrew", by="mallory")
    assert done.status_code == 303
    [audit] = decisions(engine)
    assert done.headers["location"] == f"/task?id={task_id}&cancelled={audit['id']}"
    assert (audit["task_id"], audit["requested_by"], audit["reason"]) == (
        task_id,
        OPERATOR,
        "customer withdrew",
    )
    assert task_id in task_ids(engine, "cancelled")
    with engine.connect() as conn:
        reply = sa.select(messages.c.destination).where(messages.c.task_id == task_id)
        assert conn.execute(reply).scalar_one() == "orders"
    shown = console.get(done.headers["location"]).text
    assert 'id="cancelled"' in shown
    assert 'id="cancel-form"' not in shown  # final now
    assert f"<title>task {task_id} · outbox console</title>" in shown
    assert shown.count('id="decisions"') == 1
    decided = shown.split('id="decisions"', 1)[1]
    assert '<td class="by">' + OPERATOR in decided  # its decisions listed
    # A made-up audit id in the link shows no banner: it names no decision of this task.
    assert 'id="cancelled"' not in console.get(f"/task?id={task_id}&cancelled=999").text


@pytest.mark.parametrize(
    ("reason", "operator", "why", "status"),
    [("  ", OPERATOR, NO_REASON, 400), ("why", None, "no operator name for the audit", 403)],
    ids=["no reason", "no operator"],
)
def test_a_cancel_is_refused_with_the_reason_and_changes_nothing(
    make_client: Client,
    engine: sa.Engine,
    reason: str,
    operator: str | None,
    why: str,
    status: int,
) -> None:
    task_id = task_ids(engine, "pending")[0]
    refused = cancel(make_client(operator=operator), task_id, reason=reason)
    assert refused.status_code == status
    assert f"Not cancelled: {why}" in refused.text
    assert decisions(engine) == []
    assert task_id in task_ids(engine, "pending")


def test_a_final_task_offers_no_cancel_and_refuses_one(
    make_client: Client, engine: sa.Engine
) -> None:
    [task_id] = task_ids(engine, "done")
    console = make_client(operator=OPERATOR)
    assert 'id="cancel-form"' not in console.get(f"/task?id={task_id}").text
    refused = cancel(console, task_id, reason="why")
    assert refused.status_code == 409
    assert f"Not cancelled: task is done (final), not cancelled: &#39;{task_id}&#39;" in (
        refused.text
    )
    assert cancel(console, "no-such-task", reason="why").status_code == 404
    assert decisions(engine) == []


def test_a_read_only_console_offers_and_takes_no_cancel(
    make_client: Client, engine: sa.Engine
) -> None:
    task_id = task_ids(engine, "pending")[0]
    console = make_client(read_only=True, operator=OPERATOR)
    assert 'id="cancel-form"' not in console.get(f"/task?id={task_id}").text
    assert cancel(console, task_id, reason="why").status_code == 403
    assert decisions(engine) == []
    assert task_id in task_ids(engine, "pending")
