"""Reconciling tasks: deadlines that passed and leases that expired, each with its reply.

A task past its deadline ends `expired`; a running task whose lease expired goes back
to `pending`, or ends `failed` when it has no attempt left. TaskQueue runs this in its
claims (on the worker's cadence) and in reconcile().
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from outbox.drivers import driver_for
from outbox.messages import ReplyError, TaskReply, add_task_replies
from outbox.states import ErrorCode, TaskState


def reconcile_in(
    conn: Connection, now: float | None, destination: str, limit: int
) -> dict[str, int]:
    """Expire up to `limit` tasks past their deadline and take back up to `limit` expired
    leases, with the replies of those that end; never commits. The counts per outcome."""
    driver = driver_for(conn)
    expired = [
        (ended.task_id, ended.reason) for ended in driver.expire_past_deadline(conn, now, limit)
    ]
    reaped = driver.reap_expired_task_leases(conn, now, limit)
    failed = [(task_id, why) for task_id, state, why in reaped if state == TaskState.FAILED]
    add_task_replies(
        conn,
        [
            TaskReply(task_id, TaskState.EXPIRED, error=ReplyError(ErrorCode.DEADLINE_PASSED, why))
            for task_id, why in expired
        ]
        + [
            TaskReply(task_id, TaskState.FAILED, error=ReplyError(ErrorCode.LEASE_EXPIRED, why))
            for task_id, why in failed
        ],
        destination,
        now,
    )
    return {
        "expired": len(expired),
        "requeued": len(reaped) - len(failed),
        "failed": len(failed),
    }
