"""The errors family of the driver interface: what a backend's DBAPI errors mean.

outbox.db.retry holds the toolkit's one retry policy; which errors it retries is each
backend's to say, since only the driver knows its DBAPI's codes (PostgreSQL's
SQLSTATEs, SQLite's result codes, MySQL's error numbers).
"""

from __future__ import annotations

from typing import Protocol


class ErrorsDriver(Protocol):
    """A backend's DBAPI errors, read."""

    @property
    def database_errors(self) -> tuple[type[Exception], ...]:
        """The errors the backend's own client raises where SQLAlchemy does not wrap them (a
        held connection's), besides SQLAlchemy's DBAPIError (read-only: a driver may import
        an optional client at the first look)."""
        ...

    def transient(self, error: BaseException | None) -> bool | None:
        """Whether `error` may pass on a second try on a fresh connection (a lost
        connection, a deadlock, a lock or resource that frees up); None when it is not an
        error of this backend's DBAPI."""
        ...

    def waited_for_lock(self, error: BaseException | None) -> bool:
        """Whether `error` ended a wait for a lock that the server or the connection
        already bounded: another try at once would wait as long again."""
        ...

    def is_missing_table(self, error: BaseException | None) -> bool:
        """Whether `error` says a table the statement names does not exist."""
        ...

    def refused_statement(self, error: BaseException | None) -> bool:
        """Whether `error` is the server's own refusal of the statement (a trigger's, a
        limit's), which no later try passes, though the DBAPI calls it operational."""
        ...
