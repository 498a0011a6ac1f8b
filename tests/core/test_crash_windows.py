"""Crash windows of intake, claim and finish.

The rules: docs/explanation/contract.md#failure-windows-and-guarantees.

In-process, an armed failpoint raises Crash (a BaseException) at the exact step;
in a child process, OUTBOX_FAILPOINT makes the process die there with os._exit.
Before a commit nothing of the step survives; after it, all of it does, even
though the caller never heard back. A fresh queue then recovers.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import AuthContext, BatchFailed, Envelope, Fenced, TaskQueue, failpoints
from outbox.errors import ConfigError
from outbox.failpoints import Crash, arm
from outbox.testing import ManualClock

A = AuthContext("agent-a")
LEASE = 10.0
ROOT = Path(__file__).resolve().parents[2]


def the_envelope(clock_start: float, message_id: str = "crash-1") -> Envelope:
    """The envelope both the child and the test process submit (identical bytes)."""
    return Envelope(message_id, "agent-a", {"n": 1}, clock_start + 3600)


def task_id_of(queue: TaskQueue, message_id: str = "crash-1") -> str | None:
    with queue.engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT task_id FROM outbox_inbox WHERE message_id = :m"), {"m": message_id}
        ).scalar()
    return None if found is None else str(found)


def count(queue: TaskQueue, table: str) -> int:
    with queue.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def replies_of(queue: TaskQueue, task_id: str) -> list[dict[str, Any]]:
    return [r for r in queue.messages() if r["task_id"] == task_id]


def assert_done_once(queue: TaskQueue, task_id: str, result: Any) -> None:
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["result"]) == ("done", result)
    [reply] = replies_of(queue, task_id)
    assert json.loads(reply["body"]) == {
        "kind": "result",
        "task_id": task_id,
        "status": "done",
        "result": result,
    }
    assert len(queue.messages()) == 1


def test_failpoints_are_unarmed_by_default() -> None:
    assert os.environ.get(failpoints.ENV_VAR) is None
    failpoints.hit("intake.before_commit")  # no effect when nothing is armed


def test_arm_validates_and_counts_arrivals() -> None:
    with pytest.raises(ValueError, match="unknown failpoint"), arm("no.such.point"):
        pass
    with pytest.raises(ValueError, match="skip"), arm("claim.after_commit", skip=-1):
        pass
    with arm("claim.after_commit", skip=2):
        failpoints.hit("claim.after_commit")
        failpoints.hit("claim.after_commit")
        with pytest.raises(Crash):
            failpoints.hit("claim.after_commit")
        failpoints.hit("claim.after_commit")  # fires once only
    failpoints.hit("claim.after_commit")


def test_the_environment_names_a_known_point_and_action(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv(failpoints.SWITCH_VAR, "1")
        monkeypatch.setenv(failpoints.ENV_VAR, "no.such.point")
        failpoints.read_environment()  # records the problem: `import outbox` never fails
        with pytest.raises(ConfigError, match="unknown failpoint"):
            failpoints.check()
        monkeypatch.setenv(failpoints.ENV_VAR, "claim.after_commit")
        monkeypatch.setenv(failpoints.ACTION_VAR, "pause")
        failpoints.read_environment()  # records the problem: `import outbox` never fails
        with pytest.raises(ConfigError, match="OUTBOX_FAILPOINT_ACTION"):
            failpoints.check()
        monkeypatch.setenv(failpoints.SWITCH_VAR, "yes")
        failpoints.read_environment()  # records the problem: `import outbox` never fails
        with pytest.raises(ConfigError, match="OUTBOX_FAILPOINTS_ENABLED must be 1 or 0"):
            failpoints.check()
    finally:
        monkeypatch.undo()
        failpoints.read_environment()
    failpoints.hit("claim.after_commit")  # back to unarmed


@pytest.mark.parametrize("switch", [None, "0"])
def test_a_failpoint_without_the_testing_switch_is_inert_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, switch: str | None
) -> None:
    try:
        monkeypatch.setenv(failpoints.ENV_VAR, "claim.after_commit")
        if switch is not None:
            monkeypatch.setenv(failpoints.SWITCH_VAR, switch)
        with caplog.at_level(logging.WARNING, logger="outbox.failpoints"):
            failpoints.read_environment()
            failpoints.announce()  # a command does so once its logging is configured
        assert not failpoints.armed("claim.after_commit")
        failpoints.hit("claim.after_commit")  # inert: the test process goes on
    finally:
        monkeypatch.undo()
        failpoints.read_environment()
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == (
        "OUTBOX_FAILPOINT=claim.after_commit is ignored: failpoints act only with the "
        "testing switch OUTBOX_FAILPOINTS_ENABLED=1"
    )


def test_an_armed_failpoint_is_named_in_a_warning_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        for variable, value in failpoints.environment("claim.after_commit", "stop").items():
            monkeypatch.setenv(variable, value)
        with caplog.at_level(logging.WARNING, logger="outbox.failpoints"):
            failpoints.read_environment()
            failpoints.announce()  # a command does so once its logging is configured
        assert failpoints.armed("claim.after_commit")
        assert not failpoints.armed("claim.before_commit")
    finally:
        monkeypatch.undo()
        failpoints.read_environment()
    assert not failpoints.armed("claim.after_commit")
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith(
        "failpoint claim.after_commit is armed (OUTBOX_FAILPOINTS_ENABLED): this process "
        "will stop itself (SIGSTOP) when it reaches it"
    )


def test_the_environment_of_a_failpoint_is_checked() -> None:
    assert failpoints.environment("intake.before_commit") == {
        "OUTBOX_FAILPOINT": "intake.before_commit",
        "OUTBOX_FAILPOINT_ACTION": "exit",
        "OUTBOX_FAILPOINTS_ENABLED": "1",
    }
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.environment("no.such.point")
    with pytest.raises(ValueError, match="action must be one of"):
        failpoints.environment("intake.before_commit", "pause")


# --- in-process ----------------------------------------------------------------------


def test_intake_crash_before_commit_stores_nothing(queue: TaskQueue, clock: ManualClock) -> None:
    with arm("intake.before_commit"), pytest.raises(Crash):
        queue.receive(A, the_envelope(clock()))
    assert (count(queue, "outbox_inbox"), count(queue, "outbox_tasks")) == (0, 0)
    assert queue.messages() == []
    ack = queue.receive(A, the_envelope(clock()))  # the source retries: the work is redone
    assert not ack.duplicate


def test_intake_crash_before_commit_of_an_expired_task_writes_no_reply(
    queue: TaskQueue, clock: ManualClock
) -> None:
    late = Envelope("late", "agent-a", {"n": 1}, clock() - 1)
    with arm("intake.before_commit"), pytest.raises(Crash):
        queue.receive(A, late)
    assert (count(queue, "outbox_tasks"), queue.messages()) == (0, [])
    ack = queue.receive(A, late)
    assert [r["task_id"] for r in queue.messages()] == [ack.task_id]


def test_intake_crash_after_commit_keeps_the_task(queue: TaskQueue, clock: ManualClock) -> None:
    with arm("intake.after_commit"), pytest.raises(Crash):
        queue.receive(A, the_envelope(clock()))
    task_id = task_id_of(queue)
    assert task_id is not None
    row = queue.task(task_id)
    assert row is not None
    assert row["state"] == "pending"
    again = queue.receive(A, the_envelope(clock()))  # the retry learns it was stored
    assert (again.task_id, again.duplicate) == (task_id, True)


def test_crash_inside_a_batch_is_not_wrapped_and_keeps_the_prefix(
    queue: TaskQueue, clock: ManualClock
) -> None:
    items = [the_envelope(clock(), f"b-{i}") for i in range(3)]
    with arm("intake.before_commit", skip=1), pytest.raises(Crash):
        queue.receive_batch(A, items)
    assert task_id_of(queue, "b-0") is not None
    assert (task_id_of(queue, "b-1"), task_id_of(queue, "b-2")) == (None, None)
    acks = queue.receive_batch(A, items)
    assert [a.duplicate for a in acks] == [True, False, False]
    # An ordinary error mid-batch still reports the committed prefix.
    with pytest.raises(BatchFailed):
        queue.receive_batch(A, [the_envelope(clock(), "b-3"), "not an envelope"])


def test_claim_crash_before_commit_leaves_the_task_pending(
    queue: TaskQueue, clock: ManualClock
) -> None:
    task_id = queue.receive(A, the_envelope(clock())).task_id
    with arm("claim.before_commit"), pytest.raises(Crash):
        queue.claim("w1")
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["fence"], row["attempts"], row["owner"]) == ("pending", 0, 0, None)
    got = queue.claim("w2")
    assert got is not None
    assert (got.task_id, got.fence, got.attempt) == (task_id, 1, 1)


def test_claim_crash_after_commit_is_recovered_by_lease_expiry(
    queue: TaskQueue, clock: ManualClock
) -> None:
    task_id = queue.receive(A, the_envelope(clock())).task_id
    with arm("claim.after_commit"), pytest.raises(Crash):
        queue.claim("w1")
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["fence"], row["attempts"], row["owner"]) == ("running", 1, 1, "w1")
    assert queue.claim("w2") is None  # the lost claim holds its lease
    clock.advance(LEASE + 1)
    got = queue.claim("w2")
    assert got is not None
    assert (got.task_id, got.fence, got.attempt) == (task_id, 2, 2)
    queue.finish(got, "recovered")
    assert_done_once(queue, task_id, "recovered")


def test_finish_crash_before_commit_keeps_the_task_running_without_reply(
    queue: TaskQueue, clock: ManualClock
) -> None:
    task_id = queue.receive(A, the_envelope(clock())).task_id
    held = queue.claim("w1")
    assert held is not None
    with arm("finish.before_commit"), pytest.raises(Crash):
        queue.finish(held, "lost")
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["result"], row["fence"]) == ("running", None, 1)
    assert queue.messages() == []
    clock.advance(LEASE + 1)
    again = queue.claim("w2")
    assert again is not None
    assert again.fence == 2
    with pytest.raises(Fenced):
        queue.finish(held, "stale")
    queue.finish(again, "redone")
    assert_done_once(queue, task_id, "redone")


def test_finish_crash_before_commit_drops_the_effect_too(
    queue: TaskQueue, clock: ManualClock
) -> None:
    task_id = queue.receive(A, the_envelope(clock())).task_id
    held = queue.claim("w1")
    assert held is not None

    def effect(session: Session) -> None:
        session.execute(
            sa.text("UPDATE outbox_tasks SET last_error = 'effect ran' WHERE task_id = :t"),
            {"t": task_id},
        )

    with arm("finish.before_commit"), pytest.raises(Crash):
        queue.finish(held, "lost", effect=effect)
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["last_error"]) == ("running", None)
    queue.finish(held, "kept", effect=effect)
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["last_error"]) == ("done", "effect ran")


def test_finish_crash_after_commit_keeps_result_and_reply(
    queue: TaskQueue, clock: ManualClock
) -> None:
    task_id = queue.receive(A, the_envelope(clock())).task_id
    held = queue.claim("w1")
    assert held is not None
    with arm("finish.after_commit"), pytest.raises(Crash):
        queue.finish(held, "kept")
    assert_done_once(queue, task_id, "kept")
    with pytest.raises(Fenced):
        queue.finish(held, "kept")  # a retry after the crash changes nothing
    clock.advance(LEASE + 1)
    assert queue.claim("w2") is None
    assert_done_once(queue, task_id, "kept")


# --- child processes -------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys

    from outbox import AuthContext, Envelope, TaskQueue
    from outbox.testing import ManualClock

    url, start = sys.argv[1], float(sys.argv[2])
    clock = ManualClock(start)
    queue = TaskQueue(url, clock=clock, allowed_sources=("agent-a",))
    ack = queue.receive(
        AuthContext("agent-a"), Envelope("crash-1", "agent-a", {"n": 1}, start + 3600)
    )
    claim = queue.claim("child")
    assert claim is not None and claim.task_id == ack.task_id
    queue.finish(claim, {"from": "child"})
    queue.close()
    print("finished without crashing")
    """
)


def run_child(db_url: str, clock: ManualClock, point: str, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    env = {**os.environ, **failpoints.environment(point)}
    done = subprocess.run(
        [sys.executable, str(script), db_url, repr(clock())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == failpoints.EXIT_CODE, (done.returncode, done.stdout, done.stderr)
    assert "finished without crashing" not in done.stdout
    # Said at start, and where it died.
    assert f"failpoint {point} is armed" in done.stderr
    assert f"failpoint {point} reached: exit" in done.stderr


def test_a_child_given_a_failpoint_without_the_switch_runs_through_and_says_so(
    db_url: str, clock: ManualClock, tmp_path: Path
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != failpoints.SWITCH_VAR}
    env[failpoints.ENV_VAR] = "finish.before_commit"
    done = subprocess.run(
        [sys.executable, str(script), db_url, repr(clock())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "finished without crashing" in done.stdout
    assert "OUTBOX_FAILPOINT=finish.before_commit is ignored" in done.stderr


def wait_for_dead_transactions(queue: TaskQueue) -> None:
    """PostgreSQL aborts a dead client's transaction when it sees the socket close.

    A SHARE lock conflicts with every writing transaction: taking it blocks (never
    skips) until the server has rolled the dead one back, so the SKIP LOCKED claims
    that follow see its rows. SQLite's locks died with the process.
    """
    if queue.engine.dialect.name != "postgresql":
        return
    with queue.engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '30s'"))
        conn.execute(
            sa.text("LOCK TABLE outbox_inbox, outbox_tasks, outbox_messages IN SHARE MODE")
        )


def crashed_child(
    db_url: str, queue: TaskQueue, clock: ManualClock, point: str, tmp_path: Path
) -> str | None:
    """Run a child that exits at `point`; the id of the task it left, if any."""
    run_child(db_url, clock, point, tmp_path)
    wait_for_dead_transactions(queue)
    return task_id_of(queue)


def parent_finishes(queue: TaskQueue, task_id: str, fence: int, attempt: int) -> None:
    """The parent claims the task with this fence and attempt, finishes it, and only once."""
    held = queue.claim("parent")
    assert held is not None
    assert (held.task_id, held.fence, held.attempt) == (task_id, fence, attempt)
    queue.finish(held, {"from": "parent"})
    assert_done_once(queue, task_id, {"from": "parent"})


def test_child_intake_before_commit(
    db_url: str, queue: TaskQueue, clock: ManualClock, tmp_path: Path
) -> None:
    assert crashed_child(db_url, queue, clock, "intake.before_commit", tmp_path) is None
    assert (count(queue, "outbox_inbox"), count(queue, "outbox_tasks")) == (0, 0)
    assert queue.messages() == []
    ack = queue.receive(A, the_envelope(clock()))
    assert not ack.duplicate
    parent_finishes(queue, ack.task_id, fence=1, attempt=1)


def test_child_intake_after_commit(
    db_url: str, queue: TaskQueue, clock: ManualClock, tmp_path: Path
) -> None:
    task_id = crashed_child(db_url, queue, clock, "intake.after_commit", tmp_path)
    assert task_id is not None
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["fence"]) == ("pending", 0)
    ack = queue.receive(A, the_envelope(clock()))
    assert (ack.task_id, ack.duplicate) == (task_id, True)
    parent_finishes(queue, task_id, fence=1, attempt=1)


def test_child_claim_before_commit(
    db_url: str, queue: TaskQueue, clock: ManualClock, tmp_path: Path
) -> None:
    task_id = crashed_child(db_url, queue, clock, "claim.before_commit", tmp_path)
    assert task_id is not None
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["fence"], row["attempts"], row["owner"]) == ("pending", 0, 0, None)
    parent_finishes(queue, task_id, fence=1, attempt=1)


def test_child_claim_after_commit(
    db_url: str, queue: TaskQueue, clock: ManualClock, tmp_path: Path
) -> None:
    task_id = crashed_child(db_url, queue, clock, "claim.after_commit", tmp_path)
    assert task_id is not None
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["fence"], row["attempts"], row["owner"]) == (
        "running",
        1,
        1,
        "child",
    )
    assert row["lease_until"] == clock() + LEASE  # the child ran on the same manual time
    assert queue.claim("parent") is None
    clock.advance(LEASE + 1)
    parent_finishes(queue, task_id, fence=2, attempt=2)


def test_child_finish_before_commit(
    db_url: str, queue: TaskQueue, clock: ManualClock, tmp_path: Path
) -> None:
    task_id = crashed_child(db_url, queue, clock, "finish.before_commit", tmp_path)
    assert task_id is not None
    row = queue.task(task_id)
    assert row is not None
    assert (row["state"], row["fence"], row["owner"], row["result"]) == (
        "running",
        1,
        "child",
        None,
    )
    assert queue.messages() == []
    assert queue.claim("parent") is None
    clock.advance(LEASE + 1)
    parent_finishes(queue, task_id, fence=2, attempt=2)


def test_child_finish_after_commit(
    db_url: str, queue: TaskQueue, clock: ManualClock, tmp_path: Path
) -> None:
    task_id = crashed_child(db_url, queue, clock, "finish.after_commit", tmp_path)
    assert task_id is not None
    assert_done_once(queue, task_id, {"from": "child"})
    ack = queue.receive(A, the_envelope(clock()))
    assert (ack.task_id, ack.duplicate) == (task_id, True)
    clock.advance(LEASE + 1)
    assert queue.claim("parent") is None
    assert queue.reconcile() == {"expired": 0, "requeued": 0, "failed": 0, "messages_requeued": 0}
    assert_done_once(queue, task_id, {"from": "child"})
