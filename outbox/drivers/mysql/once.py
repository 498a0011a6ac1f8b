"""Rows inserted once by their unique key, without ON CONFLICT or RETURNING.

MySQL's INSERT IGNORE would also turn a too-long value into a silently truncated one
(an identifier cut short is another identifier), and with the CLIENT_FOUND_ROWS flag
SQLAlchemy sets, ON DUPLICATE KEY UPDATE counts a row it left alone as one it wrote.
So the row is inserted plainly: InnoDB rolls back only the statement a duplicate key
fails, the caller's transaction goes on (no savepoint needed, unlike PostgreSQL's), and
the error says the row was there. A writer of the same key still in flight makes the
INSERT wait for its end, as PostgreSQL's ON CONFLICT does.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult

from outbox.drivers.mysql.errors import error_number

DUPLICATE_KEY = 1062


def insert_once(conn: Connection, statement: Any, params: Any = None) -> CursorResult[Any] | None:
    """Run an INSERT: its result, or None when a unique key already held its row (or one of
    its rows: the whole statement is then undone)."""
    try:
        return conn.execute(statement, params)
    except sa.exc.IntegrityError as exc:
        if error_number(exc.orig) != DUPLICATE_KEY:
            raise
        return None
