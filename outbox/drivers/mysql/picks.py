"""The two-step write MySQL has in place of UPDATE ... RETURNING: rows picked and locked,
updated by primary key, then read back.

A pick is a locking read (`FOR UPDATE`, with `SKIP LOCKED` where concurrent claimers
share the rows), so between it and its UPDATE no other transaction can change the
picked rows: the UPDATE changes exactly them, and the read-back returns what it wrote.
All three run in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection


def by_keys(column: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """`column` is one of the picked keys, the expanding list parameter :picked."""
    return column.in_(sa.bindparam("picked", expanding=True))


def picked(conn: Connection, pick: Any, params: dict[str, Any]) -> list[Any]:
    """The keys (first column) of the rows a locking pick returns, in its order."""
    return [row[0] for row in conn.execute(pick, params)]


def write_picked(
    conn: Connection, update: Any, read: Any, keys: Sequence[Any], params: dict[str, Any]
) -> list[Any]:
    """Update the picked rows by key, then read them back (none when nothing was picked)."""
    if not keys:
        return []
    conn.execute(update, {**params, "picked": list(keys)})
    return list(conn.execute(read, {**params, "picked": list(keys)}))
