"""SQLite's errors by sqlite3's result codes."""

from __future__ import annotations

import sqlite3


class SQLiteErrors:
    """sqlite3's errors read."""

    database_errors: tuple[type[Exception], ...] = (sqlite3.Error,)

    def transient(self, error: BaseException | None) -> bool | None:
        """Busy or locked, the one operational error that passes with time; None for an
        error that is not sqlite3's OperationalError."""
        if not isinstance(error, sqlite3.OperationalError):
            return None
        return self.waited_for_lock(error)

    def waited_for_lock(self, error: BaseException | None) -> bool:
        """Busy or locked: the busy timeout has already waited for the write lock."""
        return isinstance(error, sqlite3.OperationalError) and getattr(
            error, "sqlite_errorcode", None
        ) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)

    def is_missing_table(self, error: BaseException | None) -> bool:
        """sqlite3's "no such table"."""
        return isinstance(error, sqlite3.OperationalError) and str(error).startswith(
            "no such table"
        )

    def refused_statement(self, error: BaseException | None) -> bool:
        """Never said: sqlite3's operational errors mix a file that cannot be opened with
        statements the engine refuses, and the first must read as unavailable."""
        return False
