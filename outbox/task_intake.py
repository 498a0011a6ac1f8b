"""Intake's write: an accepted envelope stored as its inbox row and task, in one transaction.

The inbox row, keyed by (principal, message_id), makes intake idempotent: the same
envelope again finds it and answers with the stored task. A task already final when
it arrives (past its deadline, or over the hop limit) is stored final, with its reply.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from outbox.clock import Clock
from outbox.db import sql as db_sql
from outbox.db.dialect import now_expression
from outbox.drivers import driver_for
from outbox.errors import PayloadCollision
from outbox.intake import Accepted, Ack
from outbox.messages import ReplyError, TaskReply, add_task_replies
from outbox.states import ErrorCode, TaskState
from outbox.trace_context import TRACEPARENT, TRACESTATE, active_context


def store_accepted(
    conn: Connection, item: Accepted, clock: Clock | None, max_hops: int, destination: str
) -> Ack:
    """Store an accepted envelope on `conn`: the inbox row, its task, and, when it is final
    at once (past its deadline, over the hop limit), its reply; never commits.

    A second envelope with the same (principal, message_id) is a duplicate: its Ack names
    the stored task, or PayloadCollision when its content differs.
    """
    # The connection's backend, not the engine's: receive_tx runs on the caller's.
    dialect = conn.dialect.name
    now = float(conn.execute(db_sql.select_now(now_expression(clock, dialect))).scalar_one())
    driver = driver_for(conn)
    inserted = driver.insert_inbox(
        conn,
        item.principal,
        item.message_id,
        item.content,
        item.content_hash,
        item.task_id,
        now,
    )
    if not inserted:
        entry = driver.inbox_entry(conn, item.principal, item.message_id)
        if entry is None:
            raise RuntimeError(f"inbox row of {item.message_id!r} vanished during intake")
        stored_hash, task_id = entry
        if stored_hash != item.content_hash:
            raise PayloadCollision(
                f"message {item.message_id!r} from {item.principal!r} is stored with content "
                f"hash {stored_hash}; this envelope hashes to {item.content_hash}"
            )
        return Ack(task_id=task_id, duplicate=True)
    state, error = TaskState.PENDING, None
    if item.deadline <= now:
        state = TaskState.EXPIRED
        error = ReplyError(ErrorCode.DEADLINE_PASSED, "deadline passed before intake")
    elif item.hops >= max_hops:
        state = TaskState.HOP_LIMIT
        error = ReplyError(ErrorCode.HOP_LIMIT, f"hops {item.hops} >= max_hops {max_hops}")
    terminal = state != TaskState.PENDING
    creation = active_context()
    driver.insert_task(
        conn,
        {
            "task_id": item.task_id,
            "tenant_id": item.tenant_id,
            "payload": item.payload,
            "priority": item.priority,
            "deadline": item.deadline,
            "hops": item.hops,
            "state": state,
            "attempts": 0,
            "max_attempts": item.max_attempts,
            "available_at": now,
            "fence": 0,
            "last_error": None if error is None else error.reason,
            "created_at": now,
            "updated_at": now,
            "finished_at": now if terminal else None,
            "traceparent": creation.get(TRACEPARENT),
            "tracestate": creation.get(TRACESTATE),
        },
    )
    if terminal:
        add_task_replies(conn, [TaskReply(item.task_id, state, error=error)], destination, now)
    return Ack(task_id=item.task_id, duplicate=False)
