"""Database faults for tests: sessions killed, or the database gone, under a running component."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

import outbox
from support.environment import EMPTYING_SESSION


def terminate_other_sessions(db_url: str) -> int:
    """Kill every other session on the test database (PostgreSQL), as a restart would, but
    the tests' own emptying one: returns how many were the components'."""
    admin = outbox.create_engine(db_url)
    try:
        with admin.connect() as conn:
            return len(
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "AND application_name <> :emptying"
                    ),
                    {"emptying": EMPTYING_SESSION},
                ).all()
            )
    finally:
        admin.dispose()


@contextmanager
def database_down(engine: sa.Engine) -> Iterator[None]:
    """Within the block `engine` cannot reach its database, as if the server were gone.

    New connections are refused with the driver's own error, and a pooled one is
    dropped (closed) when checked out, so nothing is disposed under a running
    component: a connection it holds is returned and closed, not leaked.
    """
    down = engine.dialect.loaded_dbapi.OperationalError

    def refuse(*args: object) -> None:
        raise down("the database is down")

    def drop(*args: object) -> None:
        raise sa.exc.DisconnectionError("the database is down")

    sa.event.listen(engine, "do_connect", refuse)
    sa.event.listen(engine, "checkout", drop)
    try:
        yield
    finally:
        sa.event.remove(engine, "checkout", drop)
        sa.event.remove(engine, "do_connect", refuse)
