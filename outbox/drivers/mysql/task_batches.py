"""Task results and renewals on MySQL: the batch's held triples as a derived table, the
rows that still hold locked, then updated by task_id and read back where needed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.task_renewals import RENEW_SET, TaskRenewalStatements, renewed
from outbox.drivers.common.task_results import COMPLETE_SET, TaskResultStatements
from outbox.drivers.common.task_transitions import held_in_v
from outbox.drivers.mysql.clock import DATABASE_NOW
from outbox.drivers.mysql.rows import qualified, rows_table
from outbox.drivers.task_interface import Completion, Held

MYSQL_NOW = f"COALESCE(:now, {DATABASE_NOW})"
"""The batches' "now": a manual clock's, else the database's."""
HELD_COLUMNS = ("task_id", "owner", "fence")
PICKED: sa.BindParameter[Any] = sa.bindparam("picked", expanding=True)


def lock_held(rows: str, skip_locked: bool) -> str:
    """The task_ids of the rows of `rows` still held (held_in_v), locked."""
    return (
        f"SELECT t.task_id FROM outbox_tasks t JOIN {rows} v ON t.task_id = v.task_id WHERE"
        + held_in_v("t", MYSQL_NOW)
        + ("FOR UPDATE SKIP LOCKED" if skip_locked else "FOR UPDATE")
    )


def complete_update(rows: str) -> str:
    """Mark the locked tasks done with their results from `rows`."""
    return (
        f"UPDATE outbox_tasks t JOIN {rows} v ON t.task_id = v.task_id SET"
        + qualified(COMPLETE_SET.format(now=MYSQL_NOW), "t")
        + "WHERE t.task_id IN :picked"
    )


RENEW_UPDATE = sa.text(
    "UPDATE outbox_tasks SET "
    + RENEW_SET.format(now=MYSQL_NOW, lease=":lease")
    + " WHERE task_id IN :picked"
).bindparams(PICKED)
"""Extend the locked leases by :lease."""
READ_RENEWED = sa.text(
    "SELECT task_id, owner, fence, lease_until FROM outbox_tasks WHERE task_id IN :picked"
).bindparams(PICKED)


class MySQLTaskBatches(TaskRenewalStatements, TaskResultStatements):
    """Results and renewals: a locking read of the held rows, then one UPDATE."""

    def mark_done(
        self, conn: Connection, completions: Sequence[Completion], now: float | None
    ) -> set[str]:
        """Mark held tasks done with their results; the task_ids changed."""
        table, params = rows_table((*HELD_COLUMNS, "result"), completions)
        params["now"] = now
        held = [r[0] for r in conn.execute(sa.text(lock_held(table, skip_locked=False)), params)]
        if held:
            update = sa.text(complete_update(table)).bindparams(PICKED)
            conn.execute(update, {**params, "picked": held})
        return set(held)

    def renew_leases(
        self, conn: Connection, held: Sequence[Held], lease: float, now: float | None
    ) -> dict[Held, float]:
        """Extend by `lease` each of `held` that still holds; one locked by a write under
        way (its finish, say) is skipped."""
        if not held:
            return {}
        table, params = rows_table(HELD_COLUMNS, held)
        params["now"] = now
        locked = [r[0] for r in conn.execute(sa.text(lock_held(table, skip_locked=True)), params)]
        if not locked:
            return {}
        conn.execute(RENEW_UPDATE, {"now": now, "lease": lease, "picked": locked})
        return renewed(conn.execute(READ_RENEWED, {"picked": locked}))
