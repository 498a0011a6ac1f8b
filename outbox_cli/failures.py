"""How a command ends when it cannot do its work: one line, and an exit status that says why.

    0  done
    1  failed while running (a handler of the wrong kind, an unexpected error)
    2  bad command line, config file, environment or database URL; or a schema to upgrade
    3  the database cannot be reached, or refused the connection or a statement
    4  a port to listen on is in use or cannot be bound

Scripts and supervisors can tell a setup to fix (2) from a database to wait for (3).
Every line names what it is about (the database URL, the port and its flag) with
passwords and query strings hidden.
"""

from __future__ import annotations

import errno
import socket

import sqlalchemy as sa

from outbox.db.dialect import create_engine, make_url
from outbox.errors import ConfigError
from outbox.redaction import redact, redact_unparsed_url
from receiver.errors import StoreUnavailable

DONE = 0
FAILED = 1
USAGE = 2
DATABASE = 3
PORT = 4

EPILOG = """\
exit status:
  0  done
  1  failed while running
  2  bad command line, config file, environment or database URL; or a schema to upgrade
  3  the database cannot be reached, or refused the connection or a statement
  4  a port to listen on is in use or cannot be bound
"""
"""The exit statuses as `outbox --help` lists them."""


class PortUnavailable(Exception):
    """A port a command listens on cannot be bound; the message names it and its flag."""


def check_database_url(url: str) -> None:
    """ConfigError naming a database URL that cannot be parsed or is not supported, or
    whose DBAPI is not installed."""
    try:
        make_url(url)
    except sa.exc.ArgumentError:
        raise ConfigError(
            # Unparsed, its password cannot be told from its host: all before the last '@' goes.
            f"database URL {redact_unparsed_url(url)!r} is not a URL: expected "
            "postgresql://USER@HOST:5432/DATABASE (a password after USER:) or sqlite:///PATH"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"database URL {redact(url)!r}: {_first_line(exc)}") from None
    try:
        # An engine connects only when first used: this loads the URL's DBAPI, no more.
        create_engine(url).dispose()
    except (ValueError, sa.exc.ArgumentError) as exc:
        raise ConfigError(f"database URL {redact(url)!r}: {_first_line(exc)}") from None


def database_error(url: str | None, exc: sa.exc.DBAPIError) -> str:
    """The line for a database that failed to connect or answer: its URL and the cause."""
    cause = _first_line(exc.orig if exc.orig is not None else exc)
    return f"database {redact(url)}: {cause}" if url else f"database: {cause}"


def store_error(url: str | None, exc: StoreUnavailable) -> str:
    """The line for a receipt database that cannot be reached: its URL and the cause."""
    if isinstance(exc.__cause__, sa.exc.DBAPIError):
        return database_error(url, exc.__cause__)
    return _first_line(exc)


def port_unavailable(exc: OSError, host: str, port: int, flag: str) -> PortUnavailable:
    """The error for a port that could not be bound, naming it and the flag that chose it."""
    if exc.errno == errno.EADDRINUSE:
        return PortUnavailable(f"port {port} on {host} is in use ({flag})")
    if exc.errno == errno.EACCES:
        return PortUnavailable(f"port {port} on {host} needs privileges this user lacks ({flag})")
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return PortUnavailable(f"cannot listen on {host}: not an address of this host")
    return PortUnavailable(f"cannot listen on port {port} on {host} ({flag}): {exc}")


def _first_line(exc: BaseException) -> str:
    """An exception's message without the driver's hints and links on later lines."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
