"""The outbox tables. Alembic migrations create them; this module describes them.

Times are epoch seconds (double precision) so one comparison works on both
backends and against a manual clock. Partial indexes cover only the rows a
claim can take, so finished history does not slow claiming.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from outbox.ddl import (
    INNODB_INDEXES,
    INNODB_NAMES,
    MYSQL,
    MYSQL_ROUTABLE,
    TABLE_OPTIONS,
    BuiltOn,
    LongBinary,
    LongText,
    innodb_index,
)
from outbox.states import DeadDecision, MessageState, TaskDecision, TaskState

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TASK_STATES = tuple(str(state) for state in TaskState)
MESSAGE_STATES = tuple(str(state) for state in MessageState)
DEAD_DECISIONS = tuple(str(decision) for decision in DeadDecision)
FAILED_ATTEMPT_STATES = (str(MessageState.PENDING), str(MessageState.DEAD))
"""Where a failed attempt leaves its message: pending for a retry, or dead."""
TASK_DECISIONS = tuple(str(decision) for decision in TaskDecision)
UNSUCCESSFUL = "state IN ('failed', 'cancelled', 'expired', 'hop_limit')"
"""The final task states other than done."""

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)

# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigIdentity = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Epoch = sa.Double


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _partial(where: str) -> dict[str, Any]:
    return {"postgresql_where": sa.text(where), "sqlite_where": sa.text(where)}


inbox = sa.Table(
    "outbox_inbox",
    metadata,
    sa.Column("principal", sa.String(200), primary_key=True),
    sa.Column("message_id", sa.String(128), primary_key=True),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("content", LongText, nullable=False),
    sa.Column("task_id", sa.String(64), nullable=False, unique=True),
    sa.Column("received_at", Epoch(), nullable=False),
    **TABLE_OPTIONS,
)

tasks = sa.Table(
    "outbox_tasks",
    metadata,
    sa.Column("task_id", sa.String(64), primary_key=True),
    sa.Column("tenant_id", sa.String(200), nullable=False),
    sa.Column("payload", LongText, nullable=False),
    sa.Column("priority", sa.Integer(), nullable=False),
    sa.Column("deadline", Epoch(), nullable=False),
    sa.Column("hops", sa.Integer(), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False),
    sa.Column("max_attempts", sa.Integer(), nullable=False),
    sa.Column("available_at", Epoch(), nullable=False),
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_until", Epoch()),
    sa.Column("fence", sa.BigInteger(), nullable=False),
    sa.Column("result", LongText),
    sa.Column("last_error", LongText),
    sa.Column("cancel_requested_at", Epoch()),
    sa.Column("created_at", Epoch(), nullable=False),
    sa.Column("updated_at", Epoch(), nullable=False),
    sa.Column("finished_at", Epoch()),
    # The creation context: the trace context of the span the task was received in
    # (outbox.trace_context; migration o0013), which TaskQueue.task() returns.
    sa.Column("traceparent", sa.String(55)),
    sa.Column("tracestate", sa.String(512)),
    sa.CheckConstraint(_in("state", TASK_STATES), name="state"),
    sa.CheckConstraint("attempts >= 0 AND attempts <= max_attempts", name="attempts"),
    # Running tasks, for the per-tenant cap and for the reaper of expired leases, which
    # reads lease_until from the rows it walks (as many as leases are held). No index
    # names lease_until, so a heartbeat's renewal can be a HOT update (migration o0011).
    sa.Index("ix_outbox_tasks_running_tenant", "tenant_id", **_partial("state = 'running'")),
    sa.Index(
        "ix_outbox_tasks_deadline",
        "deadline",
        **_partial("state IN ('pending', 'running')"),
    ),
    **TABLE_OPTIONS,
)
# Migration o0011 leaves 30% of each outbox_tasks page free (fillfactor 70) on PostgreSQL:
# a renewal is HOT only when its new row version fits on the page.

# Claim order is priority DESC, available_at, created_at: the index walks it directly.
sa.Index(
    "ix_outbox_tasks_claimable",
    tasks.c.priority.desc(),
    tasks.c.available_at,
    tasks.c.created_at,
    **_partial("state = 'pending'"),
)

messages = sa.Table(
    "outbox_messages",
    metadata,
    sa.Column("id", BigIdentity, primary_key=True, autoincrement=True),
    sa.Column("reply_id", sa.String(200), nullable=False, unique=True),
    sa.Column("task_id", sa.String(64)),
    sa.Column("destination", sa.String(200), nullable=False),
    sa.Column("ordering_key", sa.String(200)),
    sa.Column("body", LongBinary, nullable=False),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("headers", LongText, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False),
    sa.Column("available_at", Epoch(), nullable=False),
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_until", Epoch()),
    sa.Column("fence", sa.BigInteger(), nullable=False),
    sa.Column("last_error", LongText),
    sa.Column("last_status", sa.Integer()),
    sa.Column("created_at", Epoch(), nullable=False),
    sa.Column("sent_at", Epoch()),
    # When an operator resolved the dead message: `outbox purge` ages resolved rows by it,
    # as it ages sent rows by sent_at.
    sa.Column("resolved_at", Epoch()),
    sa.CheckConstraint(_in("state", MESSAGE_STATES), name="state"),
    sa.Index(
        "ix_outbox_messages_deliverable", "available_at", "id", **_partial("state = 'pending'")
    ),
    sa.Index("ix_outbox_messages_lease", "lease_until", **_partial("state = 'sending'")),
    # Only task replies have a task_id: published messages keep no entry here, so claims
    # and settles of them (never HOT updates) write one index entry fewer.
    sa.Index(
        "uq_outbox_messages_task_id", "task_id", unique=True, **_partial("task_id IS NOT NULL")
    ),
    sa.Index(
        "ix_outbox_messages_ordering",
        "destination",
        "ordering_key",
        "id",
        **_partial("state IN ('pending', 'sending') AND ordering_key IS NOT NULL"),
    ),
    **TABLE_OPTIONS,
)
# Claims and settles change `state`, which the partial indexes name: never HOT. Room on the
# page keeps their new row versions there, where the WAL holds only the bytes that changed:
# migration o0009 sets a fillfactor of 70 on outbox_messages (PostgreSQL). Not declared
# here: SQLAlchemy 2.0 takes no storage parameters on a Table, and autogenerate compares none.

requeues = sa.Table(
    "outbox_requeues",
    metadata,
    # Every decision about a dead message (`outbox dead requeue` or `outbox dead resolve`):
    # which, who, when, why, what the destination's receipt lookup said first (a resolve
    # asks nothing: "not checked"), and the outcome it replaced. Kept, never updated, and
    # not purged with the messages. The name is older than resolves.
    sa.Column("id", BigIdentity, primary_key=True, autoincrement=True),
    sa.Column("reply_id", sa.String(200), nullable=False),
    sa.Column("requested_by", sa.String(200), nullable=False),
    sa.Column("reason", LongText, nullable=False),
    sa.Column("requested_at", Epoch(), nullable=False),
    sa.Column("receipt", sa.String(16), nullable=False),
    sa.Column("forced", sa.Boolean(), nullable=False),
    sa.Column("previous_attempts", sa.Integer(), nullable=False),
    sa.Column("previous_status", sa.Integer()),
    sa.Column("previous_error", LongText),
    sa.Column("action", sa.String(16), nullable=False),
    sa.CheckConstraint(_in("action", DEAD_DECISIONS), name="action"),
    sa.Index("ix_outbox_requeues_reply_id", "reply_id"),
    **TABLE_OPTIONS,
)

POSTGRESQL_ONLY_INDEXES = frozenset({"ix_outbox_messages_routable", "ix_outbox_messages_unkeyed"})
"""Indexes only PostgreSQL has (created with ddl_if); migrations create them there alone."""

UNKEYED_PENDING = "(CASE WHEN ordering_key IS NULL THEN state END) = 'pending'"
"""Pending and unkeyed, written so that only ix_outbox_messages_unkeyed's predicate follows."""
# PostgreSQL relays claim per destination (outbox.drivers.postgresql.claims): unkeyed
# messages along this index, each key's first undelivered message along
# ix_outbox_messages_ordering, so a claim never walks messages held back behind their key.
# SQLite's one relay walks ix_outbox_messages_deliverable instead. A claim's test of
# UNKEYED_PENDING proves this predicate and no other index's: from `state = 'pending'` a
# generic plan made while few messages were pending could choose
# ix_outbox_messages_deliverable, every pending message of every destination, keyed ones
# included, and keep it behind a backlog.
# Claim order per destination, which relays before o0012 walked (kept while they may run).
sa.Index(
    "ix_outbox_messages_routable",
    messages.c.destination,
    messages.c.available_at,
    messages.c.id,
    postgresql_where=sa.text("state = 'pending'"),
).ddl_if(dialect="postgresql")
sa.Index(
    "ix_outbox_messages_unkeyed",
    messages.c.destination,
    messages.c.available_at,
    messages.c.id,
    postgresql_where=sa.text(UNKEYED_PENDING),
).ddl_if(dialect="postgresql")

# MySQL relays claim per destination too (outbox.drivers.mysql.claims), along this index.
sa.Index(
    MYSQL_ROUTABLE,
    messages.c.state,
    messages.c.destination,
    messages.c.ordering_key,
    messages.c.available_at,
    messages.c.id,
).ddl_if(callable_=BuiltOn(*MYSQL))

# Dead messages per destination, for the relay's metrics at every scrape and `outbox dead
# list --destination`: only dead rows are indexed, so delivered history is never read.
sa.Index(
    "ix_outbox_messages_dead",
    messages.c.destination,
    messages.c.id,
    **_partial("state = 'dead'"),
)
# Resolved messages per destination, for the console's list of them (migration o0015):
# few beside the delivered history, which the list must not read.
sa.Index(
    "ix_outbox_messages_resolved",
    messages.c.destination,
    messages.c.id,
    **_partial("state = 'resolved'"),
)

relays = sa.Table(
    "outbox_relays",
    metadata,
    # Each running relay announces the destinations it delivers, until expires_at (it
    # renews every quarter lease): a pending message whose destination no live relay
    # announces is unrouted, shown by `outbox status` and the relay's metrics.
    sa.Column("owner", sa.String(200), primary_key=True),
    sa.Column("destination", sa.String(200), primary_key=True),
    sa.Column("expires_at", Epoch(), nullable=False),
    # What the console's health rows read (migration o0014), written at each announcement:
    # when this relay last announced, and its last answers from the destination (a
    # delivery accepted; an attempt that failed, with its status and error), so the
    # overview reads a row per relay, not the history.
    sa.Column("announced_at", Epoch()),
    sa.Column("last_sent_at", Epoch()),
    sa.Column("last_failed_at", Epoch()),
    sa.Column("last_status", sa.Integer()),
    sa.Column("last_error", LongText),
    sa.Index("ix_outbox_relays_destination", "destination"),
    **TABLE_OPTIONS,
)

task_decisions = sa.Table(
    "outbox_task_decisions",
    metadata,
    # Every operator's decision about a task (a cancel, from the console or `outbox task
    # cancel`): which, who, when, why. Kept, never updated, not purged (migration o0015).
    sa.Column("id", BigIdentity, primary_key=True, autoincrement=True),
    sa.Column("task_id", sa.String(64), nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("requested_by", sa.String(200), nullable=False),
    sa.Column("reason", LongText, nullable=False),
    sa.Column("requested_at", Epoch(), nullable=False),
    sa.CheckConstraint(_in("action", TASK_DECISIONS), name="action"),
    sa.Index("ix_outbox_task_decisions_task_id", "task_id"),
    **TABLE_OPTIONS,
)

failed_attempts = sa.Table(
    "outbox_failed_attempts",
    metadata,
    # Each attempt to deliver a message that did not end in its delivery (a retry, a death,
    # a lease that expired mid-send), written in the transaction that records its outcome
    # (on PostgreSQL, the same statement), for the timeline of the reply's page (migration
    # o0016). A delivery accepted writes nothing here: the drain's path is unchanged.
    # Deleted with its message by `outbox purge`.
    sa.Column("id", BigIdentity, primary_key=True, autoincrement=True),
    sa.Column("message_id", sa.BigInteger(), nullable=False),
    sa.Column("attempt", sa.Integer(), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("status", sa.Integer()),
    sa.Column("error", LongText),
    sa.Column("attempted_at", Epoch(), nullable=False),
    sa.CheckConstraint(_in("state", FAILED_ATTEMPT_STATES), name="state"),
    sa.Index("ix_outbox_failed_attempts_message_id", "message_id", "id"),
    **TABLE_OPTIONS,
)

backlog_samples = sa.Table(
    "outbox_backlog_samples",
    metadata,
    # Each destination's undelivered messages once a minute: how many, and the oldest's age
    # (migration o0017), for the console's chart of that age over time, which the rows
    # cannot tell after the fact. Written by whichever relay samples a minute first (one
    # row per minute and destination), kept SAMPLES_KEPT.
    sa.Column("sampled_at", Epoch(), primary_key=True),
    sa.Column("destination", sa.String(200), primary_key=True),
    sa.Column("backlog", sa.Integer(), nullable=False),
    sa.Column("oldest_age", Epoch()),
    **TABLE_OPTIONS,
)

workers = sa.Table(
    "outbox_workers",
    metadata,
    # Each running worker announces itself, until expires_at (renewed at every heartbeat),
    # for the console's list of live workers; a clean stop deletes its row, and lapsed rows
    # are deleted by the next announcement of any worker (migration o0014).
    sa.Column("owner", sa.String(200), primary_key=True),
    sa.Column("handler", sa.String(200), nullable=False),
    sa.Column("concurrency", sa.Integer(), nullable=False),
    sa.Column("started_at", Epoch(), nullable=False),
    sa.Column("announced_at", Epoch(), nullable=False),
    sa.Column("expires_at", Epoch(), nullable=False),
    **TABLE_OPTIONS,
)

# What `outbox console` charts per minute, each read through its timestamp's index over
# the charted window only: messages created, sent and dead (by when their last attempt
# fell due, the nearest stored time to their death), and tasks finished.
# BRIN on PostgreSQL: a B-tree over every message would take an entry for each claim's
# and settle's new row version; a page range's summary changes only when a version falls
# outside its bounds (migration o0010).
sa.Index("ix_outbox_messages_created", messages.c.created_at, postgresql_using="brin")
sa.Index("ix_outbox_messages_sent", messages.c.sent_at, **_partial("state = 'sent'"))
sa.Index("ix_outbox_messages_died", messages.c.available_at, **_partial("state = 'dead'"))
sa.Index("ix_outbox_tasks_finished", tasks.c.finished_at, **_partial("finished_at IS NOT NULL"))
# Tasks that ended other than done, for the console's lists of them (migration o0015): few
# beside the done history, which such a list must not read. A done task's row versions
# never match the predicate, so finishing one writes no entry here.
sa.Index(
    "ix_outbox_tasks_unsuccessful",
    tasks.c.finished_at,
    **_partial(UNSUCCESSFUL),
)

# MySQL has no partial indexes: each state-predicated one is built on PostgreSQL and SQLite
# alone, and its InnoDB counterpart (outbox.ddl, which says why) on MySQL alone.
for _table in (tasks, messages):
    for _index in list(_table.indexes):
        if _index.name in INNODB_INDEXES:
            _index.ddl_if(callable_=BuiltOn("postgresql", "sqlite"))
            innodb_index(_table, str(_index.name))


def index_on_backend(name: str | None, dialect_name: str) -> bool:
    """Whether the index `name` is one the migrations build on this backend."""
    if name in POSTGRESQL_ONLY_INDEXES:
        return dialect_name == "postgresql"
    if name in INNODB_INDEXES:
        return dialect_name not in MYSQL
    if name in INNODB_NAMES:
        return dialect_name in MYSQL
    return True
