"""The core's statements about tasks, named for what they do (intake's are the drivers').

Each state change is a guarded UPDATE whose WHERE clause names the state,
the owner and the fence; a statement that touches zero rows means the caller
lost its lease. "now" is always a parameter (database clock or manual clock).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from outbox.db.dialect import (
    UNPREPARED,
    bound_now,
    database_now,
    is_postgresql,
    supports_skip_locked,
)
from outbox.db.sql import Now, limit_parameter, picked_once, state_literal, state_unindexed
from outbox.schema import tasks
from outbox.states import TaskState

CLAIM_RETURNING = (
    tasks.c.task_id,
    tasks.c.owner,
    tasks.c.fence,
    tasks.c.attempts,
    tasks.c.payload,
    tasks.c.lease_until,
    tasks.c.deadline,
    tasks.c.tenant_id,
    tasks.c.priority,
    tasks.c.available_at,
    tasks.c.created_at,
)


# --- claiming ---------------------------------------------------------------
#
# The statements a worker runs for every task are built once per dialect with bound
# parameters: SQLAlchemy then reuses their compiled SQL, and building them anew for
# each call cost more CPU than the database spent running them. Each binds `now` as a
# manual clock's time, or None for the database's clock (read in the statement).


def _running_tenants_at_cap() -> sa.Select[Any]:
    running = tasks.alias("running")
    return (
        sa.select(running.c.tenant_id)
        .where(running.c.state == state_literal(TaskState.RUNNING))
        .group_by(running.c.tenant_id)
        .having(sa.func.count() >= sa.bindparam("tenant_cap", type_=sa.Integer()))
    )


@functools.cache
def claim_tasks(dialect_name: str, capped: bool, manual_clock: bool) -> Any:
    """Take up to :limit best claimable tasks for :claim_owner under a :lease; built once.

    Claimable: pending, due, not cancelled, inside their deadline. When `capped`,
    tenants already running :tenant_cap tasks are skipped. `now` is bound only
    for a manual clock: with a bound `now`, PostgreSQL's generic plan walks the
    deadline index and sorts every unfinished task, where the database's clock
    written into the SQL keeps the walk in claim order (tests/test_claim_plans.py).
    On PostgreSQL it runs under claim_session's setting.
    """
    now = sa.bindparam("now", type_=sa.Double()) if manual_clock else database_now(dialect_name)
    candidate = tasks.alias("candidate")
    pick = (
        sa.select(candidate.c.task_id)
        .where(
            candidate.c.state == state_literal(TaskState.PENDING),
            candidate.c.available_at <= now,
            candidate.c.cancel_requested_at.is_(None),
            candidate.c.deadline > now,
        )
        .order_by(candidate.c.priority.desc(), candidate.c.available_at, candidate.c.created_at)
        .limit(limit_parameter())
    )
    if capped:
        pick = pick.where(candidate.c.tenant_id.not_in(_running_tenants_at_cap()))
    claim = (
        sa.update(tasks)
        .values(
            state=TaskState.RUNNING.value,
            owner=sa.bindparam("claim_owner", type_=sa.String()),
            lease_until=now + sa.bindparam("lease", type_=sa.Double()),
            fence=tasks.c.fence + 1,
            attempts=tasks.c.attempts + 1,
            updated_at=now,
        )
        .returning(*CLAIM_RETURNING)
    )
    if not is_postgresql(dialect_name):
        return claim.where(
            tasks.c.task_id.in_(picked_once(pick, supports_skip_locked(dialect_name))),
            tasks.c.state == state_literal(TaskState.PENDING),
        )
    # The picks as an array, found by primary-key probes, and a state test no partial
    # index's predicate follows from: with statistics taken while no task was pending,
    # `IN (picks) AND state = 'pending'` was a semi-join walking ix_outbox_tasks_deadline
    # (every unfinished task) at each claim (tests/test_claim_plans.py). The picks are
    # locked, so a row one of them names is still the one picked. The rows come back in
    # the pick's order, which probes by primary key would not keep.
    picked = pick.with_for_update(skip_locked=True).cte("picked").prefix_with("MATERIALIZED")
    ids = sa.func.array(sa.select(*picked.c).scalar_subquery())
    claimed = claim.where(
        tasks.c.task_id == sa.any_(ids), state_unindexed(tasks.c.state, TaskState.PENDING)
    ).cte("claimed")
    return sa.select(claimed).order_by(sa.func.array_position(ids, claimed.c.task_id))


@functools.cache
def claim_tasks_psycopg(manual_clock: bool) -> tuple[str, dict[str, Any]]:
    """claim_tasks on PostgreSQL without a tenant cap, as psycopg SQL text, with the values
    of its fixed parameters; :claim_owner, :lease, :limit (and :now) are bound per claim."""
    dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
    compiled = claim_tasks("postgresql", False, manual_clock).compile(dialect=dialect)
    return str(compiled), dict(compiled.params)


def claim_session(dialect_name: str) -> str | None:
    """The session setting of the connection claims run on, or None (SQLite)."""
    if not is_postgresql(dialect_name):
        return None
    # Without sorts: the pick then walks ix_outbox_tasks_claimable in claim order and stops
    # at its limit. With statistics taken while no task was pending, both partial indexes
    # of pending tasks look empty, and a plan walked ix_outbox_tasks_deadline (every
    # unfinished task) and sorted, in generic and custom plans alike; no predicate the pick
    # could test proves the claimable index's `state = 'pending'` without also proving the
    # deadline index's `state IN ('pending', 'running')` (tests/test_claim_plans.py).
    # Without JIT: the sort of the claimed rows into pick order then costs as a disabled
    # sort, past jit_above_cost, and JIT would compile anew at every claim.
    return CLAIM_SETTING.format(local="false")


CLAIM_SETTING = (
    "SELECT set_config('enable_sort', 'off', {local}), set_config('jit', 'off', {local})"
)
"""claim_session's setting; `local` "true" for a claim inside a transaction of the pool's."""


def claim_transaction_setting(conn: sa.Connection) -> None:
    """Give a claim inside a transaction (it reconciles, or counts a tenant cap) the claim
    session's setting, until that transaction ends; the held lane has it already."""
    autocommit = conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    if is_postgresql(conn.dialect.name) and not autocommit:
        conn.exec_driver_sql(CLAIM_SETTING.format(local="true"))


def lock_tenant_caps() -> sa.Select[Any]:
    """Serialize capped claims on PostgreSQL: two claimers never take one tenant's last slot."""
    return sa.select(sa.func.pg_advisory_xact_lock(sa.literal(0x6F7574626F78)))


# --- ownership-guarded transitions -------------------------------------------


def _held(now: Now) -> sa.ColumnElement[bool]:
    """:held_task is running under :holder and :held_fence, inside its lease and deadline."""
    return sa.and_(
        tasks.c.task_id == sa.bindparam("held_task", type_=sa.String()),
        tasks.c.state == state_literal(TaskState.RUNNING),
        tasks.c.owner == sa.bindparam("holder", type_=sa.String()),
        tasks.c.fence == sa.bindparam("held_fence", type_=sa.BigInteger()),
        tasks.c.lease_until > now,
        tasks.c.deadline > now,
    )


# Many tasks finish in one statement: each row is matched by its (task_id, owner, fence)
# triple and the same lease and deadline guard as _held, so a stale holder's row is left
# as it is and missing from RETURNING. The rows travel as one JSON document, so the SQL
# text is the same whatever the batch size; on PostgreSQL not as one array per column,
# which psycopg dumps element by element in Python at several times json.dumps' cost.
_COMPLETE_SET = """
    state = 'done', result = v.result, lease_until = NULL, finished_at = {now}, updated_at = {now}
"""
_HELD_IN_V = """
    {t}.task_id = v.task_id AND {t}.state = 'running' AND {t}.owner = v.owner
    AND {t}.fence = v.fence AND {t}.lease_until > {now} AND {t}.deadline > {now}
"""
_PG_NOW = f"COALESCE(%(now)s::float8, {database_now('postgresql')})"
# PostgreSQL writes the replies in the same statement, from the rows the UPDATE changed:
# one round trip for a whole batch, and atomic alone.
COMPLETE_POSTGRESQL = (
    """WITH v AS (
        SELECT CAST(e->>0 AS varchar) AS task_id, CAST(e->>1 AS varchar) AS owner,
            CAST(e->>2 AS bigint) AS fence, e->>3 AS result,
            CAST(e->>4 AS varchar) AS reply_id, CAST(e->>5 AS varchar) AS destination,
            decode(e->>6, 'hex') AS body, CAST(e->>7 AS varchar) AS content_hash
        FROM json_array_elements(CAST(%(rows)s AS json)) AS e
    ), done AS (
        UPDATE outbox_tasks AS t SET"""
    + _COMPLETE_SET.format(now=_PG_NOW)
    + "FROM v WHERE"
    + _HELD_IN_V.format(t="t", now=_PG_NOW)
    + """RETURNING t.task_id
    ), replies AS (
        INSERT INTO outbox_messages (reply_id, task_id, destination, body, content_hash,
            headers, state, attempts, fence, available_at, created_at)
        SELECT v.reply_id, v.task_id, v.destination, v.body,
            v.content_hash, '{}', 'pending', 0, 0, """
    + _PG_NOW
    + ", "
    + _PG_NOW
    + """
        FROM v JOIN done ON done.task_id = v.task_id
    )
    SELECT task_id FROM done"""
)
_SQLITE_NOW = f"COALESCE(:now, {database_now('sqlite')})"
COMPLETE_SQLITE = sa.text(
    "UPDATE outbox_tasks SET"
    + _COMPLETE_SET.format(now=_SQLITE_NOW)
    + """FROM (
        SELECT json_extract(value, '$[0]') AS task_id, json_extract(value, '$[1]') AS owner,
               json_extract(value, '$[2]') AS fence, json_extract(value, '$[3]') AS result
        FROM json_each(:rows)
    ) AS v
    WHERE"""
    + _HELD_IN_V.format(t="outbox_tasks", now=_SQLITE_NOW)
    + "RETURNING outbox_tasks.task_id"
)

# A heartbeat renews every lease a worker holds in one statement: each row matched by
# (task_id, owner, fence) and the held guard, as a finish is. On PostgreSQL a row locked
# right now (its finish or failure being written) is skipped, not waited for: waiting in
# one multi-row statement while a batch of finishes waits on another is a deadlock, and
# a row being finished needs no renewal (if that write rolls back, the next beat renews).
_RENEW_SET = "lease_until = {now} + {lease}, updated_at = {now}"
RENEW_POSTGRESQL = (
    """WITH v AS (
        SELECT * FROM unnest(
            CAST(%(task_ids)s AS varchar[]), CAST(%(owners)s AS varchar[]),
            CAST(%(fences)s AS bigint[])
        ) AS v(task_id, owner, fence)
    ), held AS MATERIALIZED (
        SELECT t.task_id FROM outbox_tasks AS t, v
        WHERE"""
    + _HELD_IN_V.format(t="t", now=_PG_NOW)
    # The ids again as an array: primary-key probes, not a walk over every running task.
    + """AND t.task_id = ANY(CAST(%(task_ids)s AS varchar[]))
        FOR UPDATE OF t SKIP LOCKED
    )
    UPDATE outbox_tasks AS t SET """
    + _RENEW_SET.format(now=_PG_NOW, lease="%(lease)s::float8")
    + """
    FROM held WHERE t.task_id = held.task_id
    RETURNING t.task_id, t.owner, t.fence, t.lease_until"""
)
RENEW_SQLITE = sa.text(
    "UPDATE outbox_tasks SET "
    + _RENEW_SET.format(now=_SQLITE_NOW, lease=":lease")
    + """ FROM (
        SELECT json_extract(value, '$[0]') AS task_id, json_extract(value, '$[1]') AS owner,
               json_extract(value, '$[2]') AS fence
        FROM json_each(:rows)
    ) AS v
    WHERE"""
    + _HELD_IN_V.format(t="outbox_tasks", now=_SQLITE_NOW)
    + """RETURNING outbox_tasks.task_id, outbox_tasks.owner, outbox_tasks.fence,
        outbox_tasks.lease_until"""
)

Held = tuple[str, str, int]
"""(task_id, owner, fence) of a held lease."""


def renew_leases(
    conn: sa.Connection, held: Sequence[Held], lease: float, now: float | None
) -> dict[Held, float]:
    """Extend by `lease` each of `held` that still holds, in one statement: the new
    lease_until of each one extended. Missing: leases no longer held, and (PostgreSQL)
    rows locked by a write under way, which are not waited for."""
    if not held:
        return {}
    if is_postgresql(conn.dialect.name):
        task_ids, owners, fences = (list(c) for c in zip(*held, strict=True))
        params = {"task_ids": task_ids, "owners": owners, "fences": fences}
        # Planned per run: a generic plan may rescan the arrays once per row (see UNPREPARED).
        result = conn.exec_driver_sql(
            RENEW_POSTGRESQL,
            {**params, "lease": lease, "now": now},
            execution_options={UNPREPARED: True},
        )
    else:
        result = conn.execute(RENEW_SQLITE, {"rows": json.dumps(held), "lease": lease, "now": now})
    return {
        (str(task_id), str(owner), int(fence)): float(until)
        for task_id, owner, fence, until in result
    }


@functools.cache
def held_lease(dialect_name: str) -> sa.Select[Any]:
    """lease_until of :held_task while :holder still holds it under :held_fence, else no row."""
    return sa.select(tasks.c.lease_until).where(_held(bound_now(dialect_name)))


Completion = tuple[str, str, int, str]
"""(task_id, owner, fence, result as canonical JSON) of a task to mark done."""


def complete_tasks_with_replies(
    conn: sa.Connection,
    completions: Sequence[Completion],
    replies: Sequence[dict[str, Any]],
    now: float | None,
) -> set[str]:
    """PostgreSQL: mark held tasks done and insert the replies of those it changed, in one
    statement; returns their task_ids. `replies` are the completions' reply rows, in order."""
    if not completions:
        return set()
    params = complete_parameters(completions, replies, now)
    # Prepared, unlike the statements with array parameters (see UNPREPARED): no plan can
    # look inside the JSON, so the generic plan is the plan each run would get, and
    # planning this statement cost the server twice what running it did.
    result = conn.exec_driver_sql(COMPLETE_POSTGRESQL, params)
    return set(result.scalars().all())


# Built once: json.dumps with options builds an encoder per call.
_JSON_ROWS = json.JSONEncoder(ensure_ascii=False)


def complete_parameters(
    completions: Sequence[Completion], replies: Sequence[dict[str, Any]], now: float | None
) -> dict[str, Any]:
    """COMPLETE_POSTGRESQL's parameters: the completions with their reply rows, as JSON."""
    rows = [
        (task_id, owner, fence, result, *_reply_columns(reply))
        for (task_id, owner, fence, result), reply in zip(completions, replies, strict=True)
    ]
    return {"rows": _JSON_ROWS.encode(rows), "now": now}


def _reply_columns(reply: dict[str, Any]) -> tuple[str, str, str, str]:
    """A reply row's columns as COMPLETE_POSTGRESQL reads them: the body's bytes in hex."""
    return reply["reply_id"], reply["destination"], reply["body"].hex(), reply["content_hash"]


@functools.cache
def complete_task(dialect_name: str) -> sa.Update:
    """Mark one held task done with :result, in SQL any driver binds; built once."""
    now = bound_now(dialect_name)
    return (
        sa.update(tasks)
        .where(_held(now))
        .values(
            state=TaskState.DONE.value,
            result=sa.bindparam("result", type_=sa.Text()),
            lease_until=None,
            finished_at=now,
            updated_at=now,
        )
        .returning(tasks.c.task_id)
    )


def complete_tasks_one_by_one(
    conn: sa.Connection, completions: Sequence[Completion], now: float | None
) -> set[str]:
    """Any driver: mark held tasks done, one guarded statement each; returns the task_ids
    it changed (their replies are the caller's to insert)."""
    statement = complete_task(conn.dialect.name)
    done: set[str] = set()
    for task_id, owner, fence, result in completions:
        params = {"held_task": task_id, "holder": owner, "held_fence": fence, "now": now}
        changed = conn.execute(statement, {**params, "result": result}).scalar()
        if changed is not None:
            done.add(changed)
    return done


def complete_tasks(
    conn: sa.Connection, completions: Sequence[Completion], now: float | None
) -> set[str]:
    """SQLite: mark held tasks done with their results in one statement; returns the task_ids
    it changed (their replies are the caller's to insert)."""
    if not completions:
        return set()
    result = conn.execute(COMPLETE_SQLITE, {"rows": json.dumps(completions), "now": now})
    return set(result.scalars().all())


@functools.cache
def fail_task(dialect_name: str) -> sa.Update:
    """Send a held task back to pending after :delay, or to failed when it has no attempts left.

    :permanent fails it at once; :reason is stored as its last error. Built once.
    """
    now = bound_now(dialect_name)
    permanent = sa.bindparam("permanent", type_=sa.Boolean())
    final = sa.or_(permanent, tasks.c.attempts >= tasks.c.max_attempts)
    return (
        sa.update(tasks)
        .where(_held(now))
        .values(
            state=sa.case((final, TaskState.FAILED.value), else_=TaskState.PENDING.value),
            available_at=sa.case(
                (final, tasks.c.available_at),
                else_=now + sa.bindparam("delay", type_=sa.Double()),
            ),
            finished_at=sa.case((final, now), else_=None),
            lease_until=None,
            last_error=sa.bindparam("reason", type_=sa.Text()),
            updated_at=now,
        )
        .returning(tasks.c.state)
    )


@functools.cache
def release_task(dialect_name: str) -> sa.Update:
    """Give a held task back unrun: pending and due at once, its claim's attempt returned."""
    now = bound_now(dialect_name)
    return (
        sa.update(tasks)
        .where(_held(now))
        .values(
            state=TaskState.PENDING.value,
            available_at=now,
            lease_until=None,
            attempts=tasks.c.attempts - 1,
            updated_at=now,
        )
        .returning(tasks.c.state)
    )


@functools.cache
def cancel_task(dialect_name: str) -> sa.Update:
    """Cancel :cancelled_task at once when it is pending or running, :reason its last error;
    built once."""
    now = bound_now(dialect_name)
    return (
        sa.update(tasks)
        .where(
            tasks.c.task_id == sa.bindparam("cancelled_task", type_=sa.String()),
            tasks.c.state.in_((state_literal(TaskState.PENDING), state_literal(TaskState.RUNNING))),
        )
        .values(
            state=TaskState.CANCELLED.value,
            last_error=sa.bindparam("reason", type_=sa.Text()),
            cancel_requested_at=now,
            lease_until=None,
            finished_at=now,
            updated_at=now,
        )
    )


def select_task(task_id: str) -> sa.Select[Any]:
    """One task row."""
    return sa.select(tasks).where(tasks.c.task_id == task_id)
