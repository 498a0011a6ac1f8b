"""A task's final result written with its reply, and why a claim was refused.

Many results finish in one statement (the driver's): each row is matched by its
task, owner and fence under the lease and deadline guard, so a stale holder's
row is left as it is, and only the rows it changed get their reply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.canonical import NotCanonical, canonical_bytes
from outbox.claim import Claim
from outbox.drivers import driver_for
from outbox.drivers.task_interface import Completion
from outbox.errors import Fenced, InvalidMessage, OutboxError
from outbox.messages import TaskReply, task_reply_rows
from outbox.states import TaskState
from outbox.trace_context import active_context

ReplyContexts = Mapping[str, Mapping[str, str]]
"""Reply creation contexts (traceparent, tracestate) by task_id."""

MAX_RESULT_BYTES = 256 * 1024


def complete(
    conn: Connection,
    finished: Sequence[tuple[Claim, Any]],
    destination: str,
    now: float | None,
    contexts: ReplyContexts | None = None,
) -> list[OutboxError | None]:
    """Write `done`, each result and its reply, on an open connection; never commits.

    Returns, per (claim, result), None when written, or the InvalidMessage or
    Fenced that kept it out; the others are written regardless. Each reply's creation
    context is its task's in `contexts`, or by default the active span's.
    """
    refused, completions = prepare(finished)
    if contexts is None:
        contexts = active_contexts(claim for claim, _ in finished)
    replies = done_reply_rows(completions, destination, contexts)
    done = driver_for(conn).complete_tasks(conn, completions, replies, now)
    for index, (claim, _) in enumerate(finished):
        if refused[index] is None and claim.task_id not in done:
            refused[index] = _fenced_after_write(conn, claim)
    return refused


def prepare(
    finished: Sequence[tuple[Claim, Any]],
) -> tuple[list[OutboxError | None], list[Completion]]:
    """Per (claim, result), the InvalidMessage or Fenced known before writing (else None),
    and the completions to write: one per task, each result encoded."""
    refused: list[OutboxError | None] = [None] * len(finished)
    # One claim per task: of two claims of one task (a lost lease taken again by the
    # same worker), only the newer can hold it, and one reply row per task may exist.
    newest: dict[str, int] = {}
    for index, (claim, _) in enumerate(finished):
        other = newest.get(claim.task_id)
        if other is None or finished[other][0].fence < claim.fence:
            newest[claim.task_id] = index
    completions: list[Completion] = []
    for index, (claim, result) in enumerate(finished):
        if newest[claim.task_id] != index:
            refused[index] = Fenced(
                f"task {claim.task_id}: fence {claim.fence} of {claim.owner!r} is finished "
                "by another claim of the same task in this batch"
            )
            continue
        try:
            result_json = canonical_bytes(result, max_bytes=MAX_RESULT_BYTES).decode("utf-8")
        except NotCanonical as exc:
            invalid = InvalidMessage(f"result: {exc}")
            invalid.__cause__ = exc
            refused[index] = invalid
            continue
        completions.append((claim.task_id, claim.owner, claim.fence, result_json))
    return refused, completions


def done_reply_rows(
    completions: Sequence[Completion], destination: str, contexts: ReplyContexts
) -> list[dict[str, Any]]:
    """The reply rows of completions, in their order (the driver's complete_tasks), each
    with its task's creation context in `contexts`."""
    return task_reply_rows(
        [
            TaskReply(task_id, TaskState.DONE, result, creation=contexts.get(task_id))
            for task_id, _, _, result in completions
        ],
        destination,
    )


def active_contexts(claims: Iterable[Claim]) -> ReplyContexts:
    """The active span's trace context as every claim's reply context ({} without one)."""
    active = active_context()
    return {claim.task_id: active for claim in claims} if active else {}


def _fenced_after_write(conn: Connection, claim: Claim) -> Fenced:
    """Why a claim was refused, when the database still says; on PostgreSQL the batch
    is committed by now, so failing to read the reason must not fail the batch."""
    try:
        return fenced(conn, claim)
    except sa.exc.DBAPIError as exc:
        return Fenced(
            f"task {claim.task_id} is no longer held by {claim.owner!r} fence {claim.fence} "
            f"(why could not be read: {type(exc).__name__})"
        )


def fenced(conn: Connection, claim: Claim) -> Fenced:
    """The Fenced error saying why `claim` no longer holds its task, read from the row."""
    row = driver_for(conn).task_row(conn, claim.task_id)
    if row is None:
        why = "no such task"
    elif row["state"] != TaskState.RUNNING:
        why = f"task is {row['state']}"
    elif row["fence"] != claim.fence or row["owner"] != claim.owner:
        why = f"task is held by {row['owner']!r} under fence {row['fence']}"
    else:
        why = "lease or deadline has passed"
    return Fenced(
        f"task {claim.task_id} is no longer held by {claim.owner!r} fence {claim.fence}: {why}"
    )
