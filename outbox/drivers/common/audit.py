"""The audit page's statements, in portable Core: decisions about dead replies
(outbox_requeues) and about tasks (outbox_task_decisions), each kind walked back along its
own primary key from where its previous page ended, then merged newest first.

Neither table has an index on requested_at, and one on it would be needed for a keyset
over the merged order itself. Their primary keys grow as the rows are written, so each
kind's page reads at most `limit` rows however long its history, and the merge is done on
those rows alone.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.records import AuditedPage, AuditKind
from outbox.schema import requeues, task_decisions

SHARED = ("id", "action", "requested_by", "reason", "requested_at")
"""What every decision keeps, whatever it is about."""
REPLY_ONLY = ("receipt", "forced", "previous_attempts", "previous_status", "previous_error")
"""What a decision about a reply keeps besides: the outcome it replaced, the receipt lookup."""
SUBJECTS = ("reply_id", "task_id")
"""What a decision is about: one of the two, the other NULL."""
AUDIT_COLUMNS = ("kind", *SHARED, *SUBJECTS, *REPLY_ONLY)
"""Each row of the audit page, of either kind."""


def walked_back(table: sa.Table, before: int | None, page: AuditedPage) -> sa.Subquery:
    """The newest `page.limit` rows of `table` before id `before` (None: from its newest),
    of operator `page.by`: its primary key walked backwards."""
    query = sa.select(table)
    if before is not None:
        query = query.where(table.c.id < before)
    if page.by is not None:
        query = query.where(table.c.requested_by == page.by)
    return query.order_by(table.c.id.desc()).limit(page.limit).subquery(f"{table.name}_page")


def shaped(kind: AuditKind, walk: sa.Subquery) -> sa.Select[Any]:
    """`walk`'s rows in AUDIT_COLUMNS, NULL where its table keeps no such column."""
    # The kind and the NULLs are written in the outer SELECT of each UNION branch, not in
    # the walk: there PostgreSQL still types them from the other branch (a NULL inside a
    # subquery would be text, which a boolean column cannot be unioned with).
    columns: list[sa.ColumnElement[Any]] = [
        sa.literal_column(f"'{kind}'", sa.String()).label("kind")
    ]
    for name in AUDIT_COLUMNS[1:]:
        columns.append(walk.c[name] if name in walk.c else sa.null().label(name))
    return sa.select(*columns)


KIND_TABLES: dict[AuditKind, tuple[sa.Table, Callable[[AuditedPage], int | None]]] = {
    "reply": (requeues, lambda page: page.reply_before),
    "task": (task_decisions, lambda page: page.task_before),
}
"""Each kind's table, and where its page starts."""


def select_audit_page(page: AuditedPage) -> sa.Select[Any] | sa.CompoundSelect[Any]:
    """The page of each kind `page` asks for, in one statement (a UNION ALL of their walks)
    and in no order: `merged` orders them."""
    branches = []
    for kind in page.kinds:
        table, start = KIND_TABLES[kind]
        branches.append(shaped(kind, walked_back(table, start(page), page)))
    return branches[0] if len(branches) == 1 else sa.union_all(*branches)


def newest(row: Mapping[Any, Any]) -> tuple[float, str, int]:
    """A decision's place in the merged audit, the newest the largest."""
    return (float(row["requested_at"]), str(row["kind"]), int(row["id"]))


def merged(rows: Iterable[Mapping[Any, Any]]) -> list[dict[str, Any]]:
    """The rows of every kind, newest first, each kind's in the order of its ids."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(str(row["kind"]), []).append(dict(row))
    walks = [sorted(each, key=lambda row: int(row["id"]), reverse=True) for each in kinds.values()]
    # A merge compares the heads alone, so each kind's rows keep their id order even where
    # a time is out of it (a caller's manual clock, a long transaction): the next page of
    # a kind starts below the last id of it shown, and must find every one above it shown.
    return list(heapq.merge(*walks, key=newest, reverse=True))


def audit_rows(conn: Connection, page: AuditedPage) -> list[dict[str, Any]]:
    """Up to `page.limit` decisions of each kind, merged newest first: the first
    `page.limit` of them are the newest of all."""
    return merged(conn.execute(select_audit_page(page)).mappings())
