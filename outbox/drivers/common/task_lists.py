"""The console's lists of tasks by state, in portable Core, a page at a time from a keyset
(outbox.drivers.common.keysets), the task_id breaking ties:

    pending, running   by created_at: few beside the history, read through their partial
                       indexes (ix_outbox_tasks_claimable, ix_outbox_tasks_running_tenant)
                       and sorted
    done               by finished_at, along ix_outbox_tasks_finished
    the other final    by finished_at, along ix_outbox_tasks_unsuccessful (on MySQL, the
    states             state's range of (state, deadline), sorted: failures are few)

With a tenant, the same walk keeps that tenant's tasks: no index holds finished tasks by
tenant (one would take an entry from every finished task), so a tenant with few finished
tasks among many has its final-state lists read along the whole walk.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import state_literal
from outbox.drivers.common.keysets import keyset_page
from outbox.drivers.common.operations import LIVE_STATES
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import ListedTasks
from outbox.schema import UNSUCCESSFUL, tasks
from outbox.states import TERMINAL_TASK_STATES, TaskState

LIVE = LIVE_STATES["tasks"]
"""The states listed by creation: few, read through their partial indexes and sorted."""
UNSUCCESSFUL_STATES = frozenset(TERMINAL_TASK_STATES) - {TaskState.DONE}
"""The final states other than done, which ix_outbox_tasks_unsuccessful holds."""

TASK_LISTED_FIELDS = (
    tasks.c.task_id,
    tasks.c.tenant_id,
    tasks.c.state,
    tasks.c.priority,
    tasks.c.attempts,
    tasks.c.max_attempts,
    tasks.c.owner,
    tasks.c.last_error,
    tasks.c.created_at,
    tasks.c.available_at,
    tasks.c.finished_at,
)
"""What a list shows of each task."""


def task_listed_by(state: str) -> sa.Column[Any]:
    """The column a state's list is in the order of."""
    return tasks.c.created_at if state in LIVE else tasks.c.finished_at


def select_tasks_in_state(page: ListedTasks) -> sa.Select[Any]:
    """Up to page.limit tasks in page.state, in its list's order (newest first if asked),
    after page.after (a (key, task_id) pair the previous page ended on)."""
    key = task_listed_by(page.state)
    # The state written into the SQL: a generic plan can then use the state's partial index.
    query = sa.select(*TASK_LISTED_FIELDS, key.label("listed_key")).where(
        tasks.c.state == state_literal(page.state)
    )
    if page.state not in LIVE:
        # Said outright: ix_outbox_tasks_finished holds the rows where it is not NULL.
        query = query.where(tasks.c.finished_at.is_not(None))
    if page.state in UNSUCCESSFUL_STATES:
        # ix_outbox_tasks_unsuccessful's predicate word for word: SQLite uses a partial
        # index only for a WHERE that contains its condition, and cannot prove it from
        # `state = 'failed'` as PostgreSQL does.
        query = query.where(sa.text(UNSUCCESSFUL))
    if page.tenant is not None:
        query = query.where(tasks.c.tenant_id == page.tenant)
    return keyset_page(
        query, key, tasks.c.task_id, newest=page.newest, after=page.after, limit=page.limit
    )


class TaskListStatements(DriverPieces):
    """The console's lists of tasks by state."""

    def tasks_in_state(self, conn: Connection, page: ListedTasks) -> list[dict[str, Any]]:
        """One page of tasks in a state (ListedTasks says which, and after what), each with
        its `listed_key`, the value of the column the list is in the order of."""
        return [dict(row) for row in conn.execute(select_tasks_in_state(page)).mappings()]
