"""Bounded reconcile batches on PostgreSQL, names/free text the database cannot hold, and
which names a reply_id may take."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import AuthContext, Envelope, InvalidEnvelope, TaskQueue
from outbox.drivers import DRIVERS
from outbox.messages import are_reply_ids, is_reply_id
from outbox.testing import ManualClock


def test_reconcile_steps_take_at_most_their_limit(
    backend: str, queue: TaskQueue, clock: ManualClock
) -> None:
    # Fresh rows without planner statistics: the plan that used to rescan the pick.
    auth = AuthContext("agent-a")
    for n in range(60):
        queue.receive(auth, Envelope(f"m-{n}", "agent-a", {"n": n}, clock() + 5))
    claimed = queue.claim_many("worker-1", 30)
    assert len(claimed) == 30
    clock.advance(queue.lease + 1)  # every lease expired (deadlines still ahead)
    with queue.engine.begin() as conn:
        reaped = DRIVERS[backend].reap_expired_task_leases(conn, clock(), 7)
        assert len(reaped) == 7
        conn.rollback()
    clock.advance(10)  # now every deadline has passed too
    with queue.engine.begin() as conn:
        expired = DRIVERS[backend].expire_past_deadline(conn, clock(), 11)
        assert len(expired) == 11
        conn.rollback()


@pytest.mark.parametrize("tenant", ["", "t" * 201, "t\x00"])
def test_bad_tenant_is_refused_before_the_database(
    tenant: str, queue: TaskQueue, clock: ManualClock
) -> None:
    with pytest.raises(InvalidEnvelope, match="tenant_id"):
        queue.receive(AuthContext("agent-a", tenant), Envelope("m", "agent-a", {}, clock() + 60))
    assert queue.messages() == []
    with queue.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_tasks")).scalar() == 0


@pytest.mark.parametrize("owner", ["", "w" * 201, "w\x00"])
def test_bad_owner_is_a_value_error(owner: str, queue: TaskQueue) -> None:
    with pytest.raises(ValueError, match="owner"):
        queue.claim(owner)


def test_a_nul_in_a_failure_reason_is_kept_escaped(queue: TaskQueue, clock: ManualClock) -> None:
    ack = queue.receive(AuthContext("agent-a"), Envelope("m", "agent-a", {}, clock() + 60))
    claim = queue.claim("worker-1")
    assert claim is not None
    assert queue.fail(claim, "boom\x00here") == "pending"
    task = queue.task(ack.task_id)
    assert task is not None
    assert task["last_error"] == "boom\\x00here"


_ID_PIECES = st.sampled_from(["a", "Z", "9", "-", ":", ".", " ", "\n", "é", "batch:", "x" * 199])


@settings(max_examples=500, deadline=None)
@given(
    texts=st.lists(
        st.lists(_ID_PIECES, max_size=3).map("".join) | st.none() | st.integers(), max_size=5
    )
)
def test_reply_ids_checked_together_are_judged_as_one_by_one(texts: list[object]) -> None:
    assert are_reply_ids(texts) == all(is_reply_id(text) for text in texts)
