"""PostgreSQL's errors by SQLSTATE (psycopg 3 and asyncpg both carry `sqlstate`)."""

from __future__ import annotations

import psycopg

# Errors that pass with time: 40001 serialization failure, 40P01 deadlock, 40003
# statement completion unknown, 25006 read-only transaction (a failover under way),
# 55P03 lock not available, 57014 statement timeout or cancel.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "40003", "25006", "55P03", "57014"})
# Classes: 08 connection exception, 53 insufficient resources (too many connections),
# 57P operator intervention (shutdown, restart).
TRANSIENT_SQLSTATE_CLASSES = ("08", "53", "57P")
UNDEFINED_TABLE = "42P01"


class PostgreSQLErrors:
    """SQLSTATEs read."""

    database_errors: tuple[type[Exception], ...] = (psycopg.Error,)

    def transient(self, error: BaseException | None) -> bool | None:
        """The SQLSTATEs and classes above; None for an error without a SQLSTATE."""
        sqlstate = getattr(error, "sqlstate", None)
        if not isinstance(sqlstate, str):
            return None
        return sqlstate in TRANSIENT_SQLSTATES or sqlstate.startswith(TRANSIENT_SQLSTATE_CLASSES)

    def waited_for_lock(self, error: BaseException | None) -> bool:
        """Never: a row lock waits as long as the statement may, and the toolkit's own
        statements skip locked rows."""
        return False

    def is_missing_table(self, error: BaseException | None) -> bool:
        """SQLSTATE 42P01, undefined_table."""
        return getattr(error, "sqlstate", None) == UNDEFINED_TABLE

    def refused_statement(self, error: BaseException | None) -> bool:
        """Never needed: psycopg calls a trigger's RAISE (P0001) and a constraint's
        violation ProgrammingError or IntegrityError, never operational, and the SQLSTATEs
        it calls operational (54000 on the way to wraparound, 57, 58) are the store's."""
        return False
