"""The lock that serializes capped task claims on MySQL, held until their transaction ends.

Row locks alone would let two claimers take one tenant's last slot: each counts the
tenant's running tasks without the other's uncommitted one. PostgreSQL serializes capped
claims with a transaction's advisory lock; MySQL's named locks (GET_LOCK) belong to the
session instead, and releasing one before COMMIT would let the next claimer count
before this one's claim is visible. So the lock is released when the connection goes
back to the pool, after its transaction ended: capped claims run in a transaction of
their own on a pooled connection (TaskQueue.claim_many).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection

NAME = "CONCAT('outbox_caps_', MD5(DATABASE()))"
"""The lock's name, of this database's own: named locks are the server's, and capped claims
of unrelated databases on one server must not wait for each other (MySQL takes at most
64 characters, a database name alone as many)."""
WAIT = 30
"""Seconds a capped claim waits for another's transaction to end."""
HELD = "outbox_tenant_caps_held"
"""The pooled connection's info key while it holds the lock."""
TAKE = sa.text(f"SELECT GET_LOCK({NAME}, {WAIT})")


class TenantCapsBusy(TimeoutError):
    """Another capped claim held the lock for WAIT seconds."""


def lock_tenant_caps(conn: Connection) -> None:
    """Take the lock for the rest of `conn`'s checkout (see the module's docstring)."""
    if conn.connection.info.get(HELD):
        return  # MySQL's named locks nest: one is enough
    if conn.execute(TAKE).scalar() != 1:
        raise TenantCapsBusy(f"another capped claim held the tenant caps' lock for {WAIT} s")
    conn.connection.info[HELD] = True


def release_on_checkin(engine: sa.Engine) -> None:
    """Install, once, the release of the lock when a connection returns to the pool."""
    if not event.contains(engine, "checkin", _release):
        event.listen(engine, "checkin", _release)


def _release(dbapi_connection: Any, record: Any) -> None:
    if dbapi_connection is None or not record.info.pop(HELD, False):
        return
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"DO RELEASE_LOCK({NAME})")
    finally:
        cursor.close()
