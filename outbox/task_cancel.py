"""Cancelling a task: its state final, its one reply written, in the caller's transaction.

`TaskQueue.cancel` (a service's own) and `Operations.cancel_task` (an operator's, audited:
`outbox task cancel` and the console) both cancel through here.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from outbox.drivers import Driver
from outbox.messages import ReplyError, TaskReply, add_task_replies
from outbox.states import ErrorCode, TaskState

MAX_REASON_CHARS = 2000


def storable_reason(reason: object) -> str:
    """Free text from a worker or an operator, minus what the database cannot store."""
    return str(reason).replace("\x00", "\\x00")[:MAX_REASON_CHARS]


def cancel_in(
    conn: Connection,
    driver: Driver,
    task_id: str,
    reason: str,
    reply_destination: str,
    now: float | None,
) -> bool:
    """Cancel a pending or running task with its reply to `reply_destination`; False when it
    is already final, or there is no such task."""
    if not driver.cancel_task(conn, task_id, reason, now):
        return False
    error = ReplyError(ErrorCode.CANCELLED, reason)
    replies = [TaskReply(task_id, TaskState.CANCELLED, error=error)]
    add_task_replies(conn, replies, reply_destination, now)
    return True
