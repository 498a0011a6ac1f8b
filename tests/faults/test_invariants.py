"""The invariant checker itself: each kind of broken row is found and counted.

A checker that cannot see a problem proves nothing: here each problem is made
on purpose, by removing the partner of a row the product wrote (the schema has
no foreign keys to stop it), and the checker must name it. The figures it
records come from this same count, before any assertion (faults.figures).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from faults.figures import REPORT_VAR, record_then_assert
from faults.invariants import Tally, out_of_order, tally
from outbox import AuthContext, Envelope, TaskQueue
from outbox.canonical import canonical_bytes
from outbox.testing import ManualClock
from receiver import ReceiptStore
from receiver.effects import record_effect

A = AuthContext("agent-a")


def finished_task(queue: TaskQueue, clock: ManualClock, name: str) -> str:
    """A task received, claimed and finished (its reply pending); its id."""
    ack = queue.receive(A, Envelope(name, "agent-a", {"n": 1}, clock() + 3600))
    claim = queue.claim("w")
    assert claim is not None
    assert claim.task_id == ack.task_id
    queue.finish(claim, "ok")
    return ack.task_id


def run(queue: TaskQueue, statement: str, **params: object) -> None:
    """One write of the test's own, committed."""
    with queue.engine.begin() as conn:
        conn.execute(sa.text(statement), params)


def test_a_consistent_database_is_clean_but_for_what_is_pending(
    queue: TaskQueue, clock: ManualClock, db_url: str
) -> None:
    finished_task(queue, clock, "m-1")
    found = tally(db_url, acknowledged=[("agent-a", "m-1")])
    # The reply is not sent yet: stuck, and nothing else.
    assert (found.tasks, found.messages) == (1, 1)
    assert found.broken() == {"stuck": 1}, found.problems


BREAKAGES: dict[str, tuple[Callable[[TaskQueue, str], None], str, str]] = {
    "task without its inbox row": (
        lambda q, t: run(q, "DELETE FROM outbox_inbox WHERE task_id = :t", t=t),
        "orphaned",
        "has no inbox row",
    ),
    "reply whose task is gone": (
        lambda q, t: run(q, "DELETE FROM outbox_tasks WHERE task_id = :t", t=t),
        "orphaned",
        "which is gone",
    ),
    "requeue record without its reply": (
        lambda q, t: run(
            q,
            "INSERT INTO outbox_requeues (reply_id, requested_by, reason, requested_at, "
            "receipt, forced, previous_attempts, action) "
            "VALUES ('gone-1', 'ops', 'test', 1.0, 'absent', :no, 0, 'requeue')",
            no=False,
        ),
        "orphaned",
        "requeue record for gone-1",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_each_orphan_the_schema_allows_is_found(
    queue: TaskQueue, clock: ManualClock, db_url: str, breakage: str
) -> None:
    task_id = finished_task(queue, clock, "m-1")
    before = tally(db_url)
    make, kind, said = BREAKAGES[breakage]
    make(queue, task_id)
    found = tally(db_url)
    assert getattr(found, kind) == getattr(before, kind) + 1, found.problems
    assert any(p.startswith(f"{kind}: ") and said in p for p in found.problems), found.problems


def test_figures_are_recorded_before_they_are_asserted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "figures.jsonl"
    monkeypatch.setenv(REPORT_VAR, str(report))
    found = Tally(messages=3)
    found.note("lost", "reply r-1 is sent but the receiver has no receipt")
    found.note("orphaned", "task t-1 has no inbox row")
    with pytest.raises(AssertionError, match="invariants broken"):
        record_then_assert("crash matrix", "sqlite", "x", runs=1, kills=1, messages=3, found=found)
    [line] = [json.loads(text) for text in report.read_text().splitlines()]
    assert (line["lost"], line["orphaned"], line["messages"]) == (1, 1, 3)


KEYED = {
    "a-1": ("d", "a", 1),
    "b-1": ("d", "b", 2),
    "a-2": ("d", "a", 3),
    "b-2": ("d", "b", 4),
    "a-3": ("d", "a", 5),
    "other-a": ("elsewhere", "a", 6),
}


def test_keys_applied_in_order_interleaved_are_in_order() -> None:
    applied = ["b-1", "a-1", "a-2", "other-a", "b-2", "unkeyed-1", "a-3"]
    assert out_of_order(KEYED, applied) == []


def test_a_message_applied_after_a_later_one_of_its_key_is_out_of_order() -> None:
    found = out_of_order(KEYED, ["a-1", "a-3", "b-2", "a-2", "b-1", "other-a"])
    assert found == [
        "a-2 (key a) applied after a-3, later in its key",
        "b-1 (key b) applied after b-2, later in its key",
    ]


def test_only_a_messages_first_effect_counts_for_its_order() -> None:
    # A second effect is a duplicate (counted as such by tally), not a reordering.
    assert out_of_order(KEYED, ["a-1", "a-2", "a-1", "a-3", "a-2"]) == []


def test_the_database_check_reads_the_order_the_receiver_applied(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = outbox.create_engine(db_url)
    try:
        for reply_id in ("k-1", "k-2"):
            with Session(engine) as session, session.begin():
                outbox.publish(session, "default", reply_id, {"id": reply_id}, ordering_key="hot")
    finally:
        engine.dispose()
    with ReceiptStore(db_url) as store:
        for reply_id in ("k-2", "k-1"):  # the later message applied first
            store.accept(reply_id, canonical_bytes({"id": reply_id}), record_effect)
    report = tmp_path / "figures.jsonl"
    monkeypatch.setenv(REPORT_VAR, str(report))
    found = tally(db_url)
    assert (found.keyed, found.out_of_order) == (2, 1), found.problems
    assert "out_of_order: k-1 (key hot) applied after k-2, later in its key" in found.problems
    with pytest.raises(AssertionError, match="out_of_order"):
        record_then_assert("key order", "x", "x", runs=1, kills=0, messages=2, found=found)
    [line] = [json.loads(text) for text in report.read_text().splitlines()]
    assert (line["keyed"], line["out_of_order"]) == (2, 1)
