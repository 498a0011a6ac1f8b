"""One task end to end on each backend: intake, claim, finish, reply."""

from __future__ import annotations

import json

from outbox import AuthContext, Envelope, TaskQueue
from outbox.testing import ManualClock


def test_task_result_and_reply_commit_together(queue: TaskQueue, clock: ManualClock) -> None:
    ack = queue.receive(AuthContext("agent-a"), Envelope("m-1", "agent-a", {"n": 1}, clock() + 60))
    assert (ack.ack, ack.duplicate) == ("stored", False)
    claim = queue.claim("worker-1")
    assert claim is not None
    assert (claim.task_id, claim.fence, claim.attempt, claim.payload) == (
        ack.task_id,
        1,
        1,
        {"n": 1},
    )
    queue.finish(claim, {"answer": 42})
    task = queue.task(ack.task_id)
    assert task is not None
    assert (task["state"], task["result"]) == ("done", {"answer": 42})
    [reply] = queue.messages()
    assert reply["reply_id"] == "reply:" + ack.task_id
    assert json.loads(reply["body"]) == {
        "kind": "result",
        "task_id": ack.task_id,
        "status": "done",
        "result": {"answer": 42},
    }
