"""The statements behind `outbox status`, `outbox dead` (list, show, requeue, resolve) and
`outbox purge`, in portable Core."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import Now as NowSQL
from outbox.db.sql import state_literal
from outbox.dead_filter import DeadFilter
from outbox.drivers.base import DeadOutcome, Now, StateTable
from outbox.drivers.common.failed_attempts import delete_failed_attempts
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import messages, requeues, tasks
from outbox.states import MessageState, TaskState

STATE_TABLES = {"tasks": tasks, "messages": messages}
LIVE_STATES: dict[StateTable, tuple[str, ...]] = {
    "tasks": (TaskState.PENDING.value, TaskState.RUNNING.value),
    "messages": (
        MessageState.PENDING.value,
        MessageState.SENDING.value,
        MessageState.DEAD.value,
    ),
}
"""The states whose rows a partial index holds (few, whatever the history): counted exactly
even where the final states are estimated."""

DEAD_FIELDS = (
    messages.c.reply_id,
    messages.c.destination,
    messages.c.task_id,
    messages.c.attempts,
    messages.c.last_status,
    messages.c.last_error,
    messages.c.created_at,
    messages.c.content_hash,
)
"""What `outbox dead list` shows of each dead message (and a requeue's receipt lookup needs)."""


def count_by_state(state: sa.Column[str]) -> sa.Select[str, int]:
    """Rows per value of a table's `state` column."""
    return sa.select(state, sa.func.count()).group_by(state)


def count_in_states(table: sa.Table, states: Sequence[str]) -> sa.CompoundSelect[str, int]:
    """(state, rows) of each of `states`: one count each, through that state's partial
    index (the state written into the SQL, so that a generic plan can use it)."""
    counts = [
        sa.select(state_literal(state), sa.func.count()).where(
            table.c.state == state_literal(state)
        )
        for state in states
    ]
    return sa.union_all(*counts)


def oldest_pending_age(table: sa.Table, now: NowSQL) -> sa.Select[Any]:
    """Seconds since the oldest pending row of `table` was created (NULL when none)."""
    return sa.select(now - sa.func.min(table.c.created_at)).where(
        table.c.state == TaskState.PENDING.value
    )


def select_dead(limit: int, now: NowSQL, chosen: DeadFilter) -> sa.Select[Any]:
    """Dead messages that match `chosen`, oldest first, each with its id and age."""
    # The state written into the SQL: a generic plan can then use ix_outbox_messages_dead.
    query = sa.select(
        messages.c.id, *DEAD_FIELDS, (now - messages.c.created_at).label("age")
    ).where(messages.c.state == state_literal(MessageState.DEAD))
    if chosen.destination is not None:
        query = query.where(messages.c.destination == chosen.destination)
    if chosen.status is not None:
        query = query.where(messages.c.last_status == chosen.status)
    if chosen.error is not None:
        query = query.where(messages.c.last_error.icontains(chosen.error, autoescape=True))
    if chosen.newer_than is not None:
        query = query.where(messages.c.created_at > now - chosen.newer_than)
    if chosen.older_than is not None:
        query = query.where(messages.c.created_at <= now - chosen.older_than)
    if chosen.after is not None:
        query = query.where(messages.c.id > chosen.after)
    if chosen.ids is not None:
        query = query.where(messages.c.id.in_(chosen.ids))
    return query.order_by(messages.c.id).limit(limit)


def select_delivery_record(reply_id: str) -> sa.Select[Any]:
    """One message's delivery record: its id, state, attempts, last status and error, when
    sent or resolved, body size."""
    return sa.select(
        messages.c.id,
        *DEAD_FIELDS,
        messages.c.state,
        messages.c.ordering_key,
        messages.c.sent_at,
        messages.c.resolved_at,
        messages.c.body,
        sa.func.length(messages.c.body).label("body_bytes"),
    ).where(messages.c.reply_id == reply_id)


def select_dead_locked(reply_ids: Sequence[str]) -> sa.Select[Any]:
    """The id, reply_id and last outcome of each dead message among `reply_ids`, their rows
    locked until the transaction ends (SQLite's BEGIN IMMEDIATE holds them all), in id
    order so that two decisions at once lock in the same order."""
    return (
        sa.select(
            messages.c.id,
            messages.c.reply_id,
            messages.c.attempts,
            messages.c.last_status,
            messages.c.last_error,
        )
        .where(
            messages.c.reply_id.in_(list(reply_ids)), messages.c.state == MessageState.DEAD.value
        )
        .order_by(messages.c.id)
        .with_for_update()
    )


def requeue_dead(message_ids: Sequence[int], now: NowSQL) -> sa.Update:
    """The dead messages `message_ids` pending again with a fresh budget; guarded by state."""
    return (
        messages.update()
        .where(messages.c.id.in_(list(message_ids)), messages.c.state == MessageState.DEAD.value)
        .values(
            state=MessageState.PENDING.value,
            attempts=0,
            available_at=now,
            owner=None,
            lease_until=None,
            last_status=None,
            last_error=None,
        )
    )


def resolve_dead(message_ids: Sequence[int], now: NowSQL) -> sa.Update:
    """The dead messages `message_ids` resolved, never to be delivered; guarded by state."""
    return (
        messages.update()
        .where(messages.c.id.in_(list(message_ids)), messages.c.state == MessageState.DEAD.value)
        .values(state=MessageState.RESOLVED.value, resolved_at=now)
    )


AUDITED = (
    "action",
    "reply_id",
    "requested_by",
    "reason",
    "receipt",
    "forced",
    "previous_attempts",
    "previous_status",
    "previous_error",
)
"""The values of a decision's audit row its caller gives (requested_at is the statement's)."""


def unique_reply_ids(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The reply_ids of audit rows, in order; ValueError when one comes twice (its audit
    rows could not be told apart)."""
    reply_ids = [str(values["reply_id"]) for values in rows]
    if len(set(reply_ids)) != len(reply_ids):
        raise ValueError("a decision's audit rows name each reply_id once")
    return reply_ids


@functools.cache
def insert_decision_audit(pieces: DriverPieces) -> sa.Insert:
    """One audit row of a decision, requested :now; built once."""
    given = {name: sa.bindparam(name, type_=requeues.c[name].type) for name in AUDITED}
    return requeues.insert().values(**given, requested_at=pieces.bound_now())


def select_state(reply_id: str) -> sa.Select[Any]:
    """One message's state, to say why a decision found nothing to change."""
    return sa.select(messages.c.state).where(messages.c.reply_id == reply_id)


def select_purgeable(cutoff: NowSQL, batch: int) -> sa.Select[Any]:
    """The ids and states of up to `batch` messages sent, or resolved, before `cutoff`, oldest
    first."""
    return (
        sa.select(messages.c.id, messages.c.state)
        .where(
            sa.or_(
                sa.and_(messages.c.state == MessageState.SENT.value, messages.c.sent_at < cutoff),
                sa.and_(
                    messages.c.state == MessageState.RESOLVED.value,
                    messages.c.resolved_at < cutoff,
                ),
            )
        )
        .order_by(messages.c.id)
        .limit(batch)
    )


def delete_messages(ids: Sequence[int]) -> sa.Delete:
    """Delete messages by id."""
    return messages.delete().where(messages.c.id.in_(list(ids)))


class OperationStatements(DriverPieces):
    """Status counts, dead lists, the guarded requeue and resolve, their audit, purges."""

    def state_counts(self, conn: Connection, table: StateTable) -> dict[str, int]:
        """Rows per state present in `table`."""
        rows = conn.execute(count_by_state(STATE_TABLES[table].c.state))
        return {name: int(count) for name, count in rows}

    def live_state_counts(self, conn: Connection, table: StateTable) -> dict[str, int]:
        """Rows in each of `table`'s LIVE_STATES, counted through their partial indexes."""
        query = count_in_states(STATE_TABLES[table], LIVE_STATES[table])
        return {name: int(count) for name, count in conn.execute(query)}

    def state_estimates(self, conn: Connection, table: StateTable) -> dict[str, int] | None:
        """Rows per state as the database's statistics estimate them; None where it keeps
        none that say so (here: SQLite and MySQL, whose counts are exact)."""
        return None

    def oldest_pending_age(self, conn: Connection, table: StateTable, now: Now) -> float | None:
        """Seconds since the oldest pending row of `table` was created, or None."""
        query = oldest_pending_age(STATE_TABLES[table], self.now_sql(now))
        age = conn.execute(query).scalar_one()
        return None if age is None else float(age)

    def dead_messages(
        self, conn: Connection, limit: int, now: Now, chosen: DeadFilter
    ) -> list[dict[str, Any]]:
        """Dead messages that match `chosen`, oldest first, each with its id and age."""
        query = select_dead(limit, self.now_sql(now), chosen)
        return [dict(row) for row in conn.execute(query).mappings()]

    def delivery_record(self, conn: Connection, reply_id: str) -> dict[str, Any] | None:
        """One message's delivery record (state, attempts, last outcome, body), or None."""
        row = conn.execute(select_delivery_record(reply_id)).mappings().first()
        return None if row is None else dict(row)

    def lock_dead(self, conn: Connection, reply_ids: Sequence[str]) -> dict[str, DeadOutcome]:
        """The dead messages among `reply_ids`, by reply_id, each with its id and last
        outcome, locked until the transaction ends."""
        rows = conn.execute(select_dead_locked(reply_ids))
        return {row.reply_id: DeadOutcome(row.id, *row[2:]) for row in rows}

    def requeue_dead(self, conn: Connection, message_ids: Sequence[int], now: Now) -> int:
        """Make dead messages pending with a fresh budget; how many were still dead."""
        if not message_ids:
            return 0
        changed = conn.execute(requeue_dead(message_ids, self.now_sql(now)))
        return int(changed.rowcount)

    def resolve_dead(self, conn: Connection, message_ids: Sequence[int], now: Now) -> int:
        """Resolve dead messages for good (keeping their last outcome); how many were still
        dead."""
        if not message_ids:
            return 0
        changed = conn.execute(resolve_dead(message_ids, self.now_sql(now)))
        return int(changed.rowcount)

    def message_state(self, conn: Connection, reply_id: str) -> str | None:
        """One message's state, or None when there is no such message."""
        state: str | None = conn.execute(select_state(reply_id)).scalar_one_or_none()
        return state

    def insert_decision_audits(
        self, conn: Connection, rows: Sequence[dict[str, Any]], now: Now
    ) -> list[dict[str, Any]]:
        """The audit rows of decisions about dead messages (a reply_id once each), requested
        `now`; returned whole, in the order given (one statement for them all)."""
        if not rows:
            return []
        reply_ids = unique_reply_ids(rows)
        # Matched by reply_id, not returned in parameter order: SQLite would run that
        # form a row at a time.
        statement = insert_decision_audit(self).returning(*requeues.c)
        audits = conn.execute(statement, [{**values, "now": now} for values in rows])
        by_reply = {row["reply_id"]: dict(row) for row in audits.mappings()}
        return [by_reply[reply_id] for reply_id in reply_ids]

    def purge_messages(
        self, conn: Connection, now: Now, older_than: float, batch: int
    ) -> list[str]:
        """Delete up to `batch` messages sent, or resolved, over `older_than` seconds ago,
        oldest first; the state of each one deleted."""
        cutoff = self.now_sql(now) - older_than
        chosen = conn.execute(select_purgeable(cutoff, batch)).all()
        if chosen:
            ids = [row.id for row in chosen]
            conn.execute(delete_messages(ids))
            conn.execute(delete_failed_attempts(ids))
        return [row.state for row in chosen]
