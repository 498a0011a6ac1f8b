"""Database drivers: every statement of the families behind the interface, one driver per
backend, and the registry that picks one.

Not public API: the core, the relay and the receiver call it, users do not.
`driver_for(engine)` (or a Connection, a Dialect or a dialect name) is the driver of
that backend, `driver_for_url(url)` the driver of a URL's; `DRIVERS` is the only list
of them, which tests/drivers runs its conformance suite against. The interface is
`base.Driver`; what is behind it and what a new backend implements:
docs/explanation/architecture.md, "Database drivers".
"""

from __future__ import annotations

import sqlalchemy as sa

from outbox.drivers.base import Driver
from outbox.drivers.mysql import MySQLDriver
from outbox.drivers.postgresql import PostgreSQLDriver
from outbox.drivers.sqlite import SQLiteDriver

# MySQL's first: PyMySQL's errors carry a SQLSTATE as well, which PostgreSQL's reading
# (outbox.db.retry asks each driver in this order) would judge by PostgreSQL's codes.
DRIVERS: dict[str, Driver] = {
    driver.name: driver for driver in (MySQLDriver(), PostgreSQLDriver(), SQLiteDriver())
}
"""Every driver, by the name of the SQLAlchemy dialect it runs on (the MySQL driver also
runs on the `mariadb` dialect: see driver_for)."""


class UnsupportedDatabase(ValueError):
    """No driver runs on this database backend."""


def driver_for(target: str | sa.Engine | sa.Connection | sa.Dialect) -> Driver:
    """The driver of a dialect name, or of an Engine's, a Connection's or a Dialect's backend."""
    name = target if isinstance(target, str) else _dialect_name(target)
    found = DRIVERS.get(name)
    if found is not None:
        return found
    # A dialect of its own name on the same backend: SQLAlchemy's `mariadb://` URLs get a
    # dialect named "mariadb", a MySQL dialect that insists on a MariaDB server.
    for driver in DRIVERS.values():
        if name in driver.url_backends:
            return driver
    raise UnsupportedDatabase(f"unsupported database {name!r}: use {_names()}")


def driver_for_url(url: str | sa.URL) -> Driver:
    """The driver of a database URL's backend (its scheme before any `+`)."""
    backend = sa.make_url(url).get_backend_name()
    for driver in DRIVERS.values():
        if backend in driver.url_backends:
            return driver
    raise UnsupportedDatabase(f"unsupported database {backend!r}: use {_names()}")


def _names() -> str:
    """The backends with a driver, for an error: "postgresql or sqlite"."""
    names = sorted(DRIVERS)
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


def _dialect_name(target: object) -> str:
    """The dialect name of an Engine, a Connection (which have a `dialect`) or a Dialect."""
    dialect = getattr(target, "dialect", target)
    name = getattr(dialect, "name", None)
    if not isinstance(name, str):
        raise TypeError(
            f"a driver is chosen by an Engine, a Connection, a Dialect or a dialect name, "
            f"not {type(target).__name__}"
        )
    return name


__all__ = ["DRIVERS", "Driver", "UnsupportedDatabase", "driver_for", "driver_for_url"]
