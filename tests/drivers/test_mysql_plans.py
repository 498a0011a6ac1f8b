"""EXPLAIN guard on MySQL: each locking pick walks its state-led InnoDB index in order,
with no sort, beside a history of finished rows (outbox.ddl says why each index)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from outbox.drivers import Driver
from outbox.drivers.mysql.claims import reap_pick, unkeyed_pick
from outbox.drivers.mysql.key_walk import head_lock, key_walk
from outbox.drivers.mysql.task_claims import task_pick
from outbox.drivers.mysql.task_reconcile import deadline_pick

pytestmark = pytest.mark.parametrize("backend", ["mysql"], indirect=True)
HISTORY = 5_000
PENDING = 50
UNROUTED = 500
KEYED = 400
PARAMS: dict[str, Any] = {
    "now": 1e7,
    "claim_owner": "relay-1",
    "lease": 30.0,
    "limit": 10,
    "budget": 3,
    "destinations": ["orders"],
    "destination": "orders",
    "skip_destinations": [],
    "after": "",
    "walk_cap": 20,
    "picked": [1, 2],
    "tenant_cap": 2,
}


@pytest.fixture
def seeded(engine: sa.Engine) -> sa.Engine:
    """HISTORY sent messages and done tasks, PENDING pending of each, KEYED pending keyed
    messages (one long key, a few short ones), UNROUTED pending messages of a destination
    nobody delivers, the statistics fresh."""
    message = (
        "INSERT INTO outbox_messages (reply_id, destination, ordering_key, body, content_hash,"
        " headers, state, attempts, available_at, fence, created_at) VALUES"
        " (%s, %s, %s, 'x', 'h', '{}', %s, 1, %s, 1, %s)"
    )
    task = (
        "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, state,"
        " attempts, max_attempts, available_at, fence, created_at, updated_at) VALUES"
        " (%s, 'agent-a', '{}', 0, 9e9, 0, %s, 1, 3, %s, 1, %s, %s)"
    )
    rows = [
        (f"h{n}", "orders", f"k{n % 50}" if n % 3 == 0 else None, "sent", n, n)
        for n in range(HISTORY)
    ]
    rows += [(f"p{n}", "orders", None, "pending", HISTORY + n, HISTORY + n) for n in range(PENDING)]
    # The long key's delivered history, which no probe for its pending messages may read.
    rows += [(f"s{n}", "orders", "hot", "sent", n, n) for n in range(HISTORY // 2)]
    # Pending keyed messages: most behind one long key's first, a few keys of one each.
    rows += [
        (f"q{n}", "orders", "hot" if n % 8 else f"k{n}", "pending", n, n) for n in range(KEYED)
    ]
    # A backlog no relay here delivers (a typo's), older than every pending message of orders.
    rows += [(f"u{n}", "ordres", None, "pending", n, n) for n in range(UNROUTED)]
    tasks = [(f"t{n}", "done", n, n, n) for n in range(HISTORY)]
    tasks += [(f"q{n}", "pending", HISTORY + n, n, n) for n in range(PENDING)]
    with engine.begin() as conn:
        conn.exec_driver_sql(message, rows)
        conn.exec_driver_sql(task, tasks)
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE TABLE outbox_messages, outbox_tasks").all()
    return engine


@pytest.fixture
def plan(seeded: sa.Engine) -> Any:
    """EXPLAIN of a statement with PARAMS: (table, key, extra) of each row of its plan."""

    def explain(conn: Any, cursor: Any, statement: str, *rest: Any) -> tuple[str, Any]:
        return "EXPLAIN " + statement, rest[0]

    def planned(statement: Any) -> list[tuple[str, str | None, str, str]]:
        sa.event.listen(seeded, "before_cursor_execute", explain, retval=True)
        try:
            with seeded.connect() as conn:
                rows = conn.execute(statement, PARAMS).mappings().all()
        finally:
            sa.event.remove(seeded, "before_cursor_execute", explain)
        return [(row["table"], row["key"], row["Extra"] or "", row["ref"] or "") for row in rows]

    return planned


def walks(steps: list[tuple[str, str | None, str, str]], table: str, index: str) -> None:
    """`table`'s step of a plan reads `index` and sorts nothing."""
    (step,) = [s for s in steps if s[0] == table]
    assert step[1] == index, steps
    assert "filesort" not in step[2], steps


def test_the_relays_claim_walks_one_destinations_unkeyed_messages_in_claim_order(
    driver: Driver, plan: Any
) -> None:
    walks(plan(unkeyed_pick(driver)), "m", "ix_outbox_messages_state_routable")


def test_the_relays_claim_walks_one_destinations_keys_in_key_order(plan: Any) -> None:
    steps = {step[0]: step for step in plan(key_walk())}
    # The keys in key order along the pending range, stopping at the cap (no sort of
    # every key first); then one probe per key for its lowest pending id.
    walks(plan(key_walk()), "m", "ix_outbox_messages_state_routable")
    assert "temporary" not in steps["m"][2], steps
    walks(plan(key_walk()), "h", "ix_outbox_messages_state_ordering")


def test_the_first_messages_of_keys_are_locked_by_primary_key(driver: Driver, plan: Any) -> None:
    steps = plan(head_lock(driver))
    assert steps[0][:2] == ("m", "PRIMARY"), steps
    # Each check for an earlier undelivered message of the key is one probe by
    # destination, key and state, never a walk through the key's delivered history.
    for table in ("earlier_pending", "earlier_sending"):
        (step,) = [step for step in steps if step[0] == table]
        assert step[1] == "ix_outbox_messages_state_ordering", steps
        assert step[3].count(",") >= 2, steps  # ref: destination, key, state


def test_the_reaper_walks_the_sending_messages_by_lease(driver: Driver, plan: Any) -> None:
    walks(plan(reap_pick(driver)), "outbox_messages", "ix_outbox_messages_state_lease")


@pytest.mark.parametrize("capped", [False, True])
def test_the_task_claim_walks_the_pending_tasks_in_claim_order(
    driver: Driver, plan: Any, capped: bool
) -> None:
    walks(plan(task_pick(driver, capped, True)), "candidate", "ix_outbox_tasks_state_claimable")


def test_expiry_walks_the_unfinished_tasks_by_deadline(driver: Driver, plan: Any) -> None:
    walks(plan(deadline_pick(driver)), "pick", "ix_outbox_tasks_state_deadline")
