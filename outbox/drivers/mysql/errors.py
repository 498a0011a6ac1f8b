"""MySQL's and MariaDB's errors by their error numbers.

The DBAPI is imported only when a MySQL URL is used (the mysql extra may be absent), so
an error is recognised by the module its class comes from and read by its number
(`args[0]` for PyMySQL and mysqlclient, `errno` for MariaDB Connector/Python).
"""

from __future__ import annotations

from functools import cached_property

from outbox.drivers.mysql.tenant_lock import TenantCapsBusy

DEADLOCK = 1213
LOCK_WAIT_TIMEOUT = 1205
NO_SUCH_TABLE = 1146
# Errors that pass with time besides those two: the connection lost or refused (2002,
# 2003, 2006, 2013, 2055; 4031, MySQL 8's "disconnected by the server"), too many
# connections (1040), the server shutting down (1053), a connection killed (1927,
# MariaDB's), the query interrupted (1317), read-only during a failover (1290, 1792).
# A statement that ran out of its time (1969, MariaDB's max_statement_time; 3024, MySQL's
# max_execution_time) passes with time, as PostgreSQL's statement timeout does.
TRANSIENT = frozenset(
    {DEADLOCK, LOCK_WAIT_TIMEOUT, 2002, 2003, 2006, 2013, 2055, 4031, 1040, 1053, 1927, 1317}
    | {1290, 1792, 1969, 3024}
)
# The server's refusals of a statement itself that PyMySQL calls OperationalError, as it
# calls every server error it has no class for (access denied, disk full, a lost node):
# SIGNAL's and RESIGNAL's (1643-1645: a trigger's or a procedure's own error) and a CHECK
# constraint's (4025 MariaDB, 3819 MySQL). Named one by one: the rest stay unavailability.
REFUSALS = frozenset({1643, 1644, 1645, 3819, 4025})
_DBAPI_MODULES = ("pymysql", "MySQLdb", "mariadb", "aiomysql", "asyncmy")


def error_number(error: BaseException | None) -> int | None:
    """The server's or client's error number of a MySQL DBAPI error, else None."""
    if error is None or type(error).__module__.split(".")[0] not in _DBAPI_MODULES:
        return None
    number = getattr(error, "errno", None)
    if not isinstance(number, int) and error.args and isinstance(error.args[0], int):
        number = error.args[0]
    return number if isinstance(number, int) else None


class MySQLErrors:
    """Error numbers read."""

    @cached_property
    def database_errors(self) -> tuple[type[Exception], ...]:
        """PyMySQL's errors, imported at the first look (the mysql extra may be absent), and
        a capped claim that waited out another's lock: the claim is tried again, as after
        any other wait the database ran out of."""
        try:
            import pymysql
        except ImportError:
            return (TenantCapsBusy,)
        return (pymysql.err.MySQLError, TenantCapsBusy)

    def transient(self, error: BaseException | None) -> bool | None:
        """Deadlocks, lock waits that ran out, lost connections (TRANSIENT); None for an
        error that is not a MySQL DBAPI's."""
        number = error_number(error)
        return None if number is None else number in TRANSIENT

    def waited_for_lock(self, error: BaseException | None) -> bool:
        """Error 1205: innodb_lock_wait_timeout already waited for the row lock."""
        return error_number(error) == LOCK_WAIT_TIMEOUT

    def is_missing_table(self, error: BaseException | None) -> bool:
        """Error 1146, "table doesn't exist"."""
        return error_number(error) == NO_SUCH_TABLE

    def refused_statement(self, error: BaseException | None) -> bool:
        """SIGNAL's, RESIGNAL's or a CHECK constraint's error (REFUSALS)."""
        return error_number(error) in REFUSALS
