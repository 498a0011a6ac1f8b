"""The end-to-end story of the queue on a throwaway SQLite database.

Every step is real work against the database; the clock is manual so lease
expiry takes no waiting. Exits non-zero if any invariant fails.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from sqlalchemy.orm import Session

import outbox
from outbox import AuthContext, Envelope, Fenced, ManualClock, TaskQueue, publish


class InvariantFailed(Exception):
    """A demo invariant did not hold."""


def check(condition: bool, what: str) -> None:
    """Print a passed invariant, or raise when it failed."""
    if not condition:
        raise InvariantFailed(what)
    print(f"   ok  {what}")


def story(url: str) -> None:
    """Run the demo story against the database at `url`."""
    outbox.upgrade(url)
    clock = ManualClock(1_700_000_000.0)
    queue = TaskQueue(url, clock=clock, allowed_sources=("agent-a",), lease=10)
    try:
        source = AuthContext("agent-a")
        print("1. intake: three tasks, each ACKed only after commit")
        acks = [
            queue.receive(source, Envelope(f"msg-{n}", "agent-a", {"n": n}, clock() + 3600))
            for n in range(1, 4)
        ]
        again = queue.receive(source, Envelope("msg-1", "agent-a", {"n": 1}, clock() + 3600))
        check(all(a.ack == "stored" and not a.duplicate for a in acks), "three new tasks stored")
        check(
            again.duplicate and again.task_id == acks[0].task_id, "a resent envelope is a duplicate"
        )

        print("2. worker-1 claims a task, then goes silent (crashed)")
        stale = queue.claim("worker-1")
        assert stale is not None
        print(f"   worker-1 holds {stale.task_id[:12]}… fence {stale.fence}")

        print("3. the lease expires; reconcile puts the task back")
        clock.advance(11)
        print(f"   reconcile: {queue.reconcile()}")

        print("4. worker-2 claims the tasks, the reclaimed one under a higher fence")
        finished = {}
        while (claim := queue.claim("worker-2")) is not None:
            queue.finish(claim, {"answer": claim.payload["n"] * 10})
            finished[claim.task_id] = claim
        fresh = finished.get(stale.task_id)
        check(fresh is not None and fresh.fence > stale.fence, "fence increased on reclaim")

        print("5. worker-1 wakes up and tries to commit")
        try:
            queue.finish(stale, {"answer": -1})
            check(False, "stale commit refused")
        except Fenced as exc:
            print(f"   Fenced: {exc}")
            check(True, "stale commit refused")

        print("6. a service publishes a message in its own transaction")
        with Session(queue.engine) as session, session.begin():
            publish(
                session, "billing", "order-17:confirmed", {"order": 17}, ordering_key="order-17"
            )

        print("7. what the relay will deliver")
        replies = queue.replies()
        print(f"   {'reply_id':<28} {'destination':<12} {'state':<8} body")
        for reply in replies:
            print(
                f"   {reply['reply_id'][:27]:<28} {reply['destination']:<12} "
                f"{reply['state']:<8} {reply['body'].decode()[:60]}"
            )
        tasks = [queue.task(a.task_id) for a in acks]
        check(all(t is not None and t["state"] == "done" for t in tasks), "every task done")
        task_replies = [r for r in replies if r["task_id"]]
        check(len(task_replies) == 3, "exactly one reply per task")
        first = next(r for r in task_replies if r["task_id"] == stale.task_id)
        check(json.loads(first["body"])["result"] == {"answer": 10}, "the reply holds the result")
    finally:
        queue.close()


def main() -> int:
    """Run the story in a temporary folder; return the exit status."""
    with tempfile.TemporaryDirectory(prefix="outbox-demo-") as folder:
        url = f"sqlite:///{Path(folder) / 'demo.db'}"
        print(f"database: {url}")
        try:
            story(url)
        except InvariantFailed as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
    print("all invariants held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
