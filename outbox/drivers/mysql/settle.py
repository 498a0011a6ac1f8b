"""The relay's settle on MySQL: the turn's rows as a derived table, locked, then updated.

The locking read finds the rows whose (id, fence), state and owner still match: no one
else can change them until the transaction ends, so the UPDATE joined to the same rows
changes exactly those, the ids the settle returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.failed_attempts import record_settled_failures
from outbox.drivers.common.settle import SETTLE_SET, SETTLE_WHERE
from outbox.drivers.mysql.clock import DATABASE_NOW
from outbox.drivers.mysql.rows import qualified, rows_table
from outbox.drivers.records import FailedAttempt, Settlement

COLUMNS = ("id", "fence", "state", "status", "error", "delay", "refund")
"""The fields of a Settlement the statements read, in its order."""
MYSQL_NOW = f"COALESCE(:now, {DATABASE_NOW})"


def lock_settled(rows: str) -> str:
    """The ids of the rows of `rows` this owner still holds under their fences, locked."""
    return (
        f"SELECT m.id FROM outbox_messages m JOIN {rows} v ON m.id = v.id WHERE"
        + SETTLE_WHERE.format(m="m", owner=":owner")
        + "FOR UPDATE"
    )


def settle_update(rows: str) -> str:
    """Write each locked row's outcome, from its row of `rows`."""
    return (
        f"UPDATE outbox_messages m JOIN {rows} v ON m.id = v.id SET"
        + qualified(SETTLE_SET.format(m="m", now=MYSQL_NOW), "m")
        + "WHERE m.id IN :picked"
    )


def settle(
    conn: Connection,
    owner: str,
    rows: Sequence[Settlement],
    now: Now,
    failures: Sequence[FailedAttempt] = (),
) -> set[int]:
    """Settle held messages: lock those still held, then update them; the ids changed."""
    if not rows:
        return set()
    table, params = rows_table(COLUMNS, [row[: len(COLUMNS)] for row in rows])
    held = [r[0] for r in conn.execute(sa.text(lock_settled(table)), {**params, "owner": owner})]
    if held:
        update = sa.text(settle_update(table)).bindparams(sa.bindparam("picked", expanding=True))
        conn.execute(update, {**params, "now": now, "picked": held})
    settled = set(held)
    record_settled_failures(conn, failures, settled, now, DATABASE_NOW)
    return settled
