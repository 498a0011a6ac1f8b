"""Which failures of the receipt store mean "not now": StoreUnavailable, worth a later try.

A lost race (a purge between an insert and its read, or a concurrent insert of the
same reply_id under a stricter isolation level), an exhausted pool, a database that
cannot be reached or fails transiently: a later try may pass. A bad statement or an
effect's own error is no such thing, and propagates as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from outbox.db import retry
from outbox.receiver_tables import receipts
from receiver.errors import StoreUnavailable


class LostRace(Exception):
    """The transaction lost a race (with purge, or another writer) it can win on a second try."""


def lost_race(exc: BaseException) -> bool:
    """A race a second try wins: a purge between insert and read, or a concurrent insert of
    the same reply_id under a stricter isolation level (a unique violation on receipts)."""
    if isinstance(exc, LostRace):
        return True
    orig = getattr(exc, "orig", None)
    diag = getattr(orig, "diag", None)
    return getattr(orig, "sqlstate", None) == "23505" and (
        getattr(diag, "table_name", None) == receipts.name
    )


def unavailable(exc: BaseException) -> str | None:
    """Why `exc` means the store cannot work now (a later try may pass), or None: it does not."""
    if isinstance(exc, sa.exc.TimeoutError):  # pool exhausted: the same advice as a busy server
        return f"no database connection available: {exc}"
    if lost_race(exc):
        return "kept losing races to store receipts; try again"
    if isinstance(exc, sa.exc.DBAPIError):
        # Cannot talk to the database, rather than a bad statement: a later try may pass.
        # PyMySQL calls a trigger's SIGNAL operational too: the server's refusal is the
        # statement's (an effect's) own error.
        operational = isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError)
        unreachable = operational and not retry.refused_statement(exc)
        if unreachable or retry.is_transient(exc):
            return f"receipt database unavailable: {exc.orig}"
    return None


@contextmanager
def unavailable_when_it_fails() -> Iterator[None]:
    """Say StoreUnavailable for what a later try may pass: pool exhausted, transient errors."""
    try:
        yield
    except Exception as exc:
        reason = unavailable(exc)
        if reason is None:
            raise
        raise StoreUnavailable(reason) from exc
