"""PostgreSQL's settle: one statement of arrays, sent in binary (outbox.drivers.postgresql.
binary_arrays), whatever the batch size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.settle import SETTLE_SET, SETTLE_WHERE
from outbox.drivers.execution import UNPREPARED
from outbox.drivers.postgresql.binary_arrays import BigInts, Floats, Integers, dumping_numbers
from outbox.drivers.postgresql.receipts import STATEMENT_NOW
from outbox.drivers.records import FailedAttempt, Settlement

# Driver SQL for psycopg: %(name)b sends an array in binary. `now` is
# a manual clock's time, or NULL for the database's (read in the statement itself).
# PostgreSQL answers with one row: the array of given ids it did not settle, usually
# empty (fenced rows are rare), instead of a row per settled message to read back. When
# it settled as many as it was given, the array is empty without hashing both lists (a
# subquery in the CASE's other branch runs only when that branch is taken).
FAILED_ATTEMPTS = f""",
    recorded AS (
        INSERT INTO outbox_failed_attempts
            (message_id, attempt, state, status, error, attempted_at)
        SELECT f.id, f.attempt, f.state, f.status, f.error,
               COALESCE(%(now)s::float8, {STATEMENT_NOW})
        FROM unnest(
            CAST(%(failed_ids)s AS bigint[]), CAST(%(failed_attempts)s AS integer[]),
            CAST(%(failed_states)s AS varchar[]), CAST(%(failed_statuses)s AS integer[]),
            CAST(%(failed_errors)s AS text[])
        ) AS f(id, attempt, state, status, error)
        WHERE f.id IN (SELECT id FROM settled)
    )"""
"""The turn's failed attempts of the messages the settle changed, recorded by it."""


def settle_statement(recording: bool) -> str:
    """The settle; with `recording`, one that also writes the turn's failed attempts."""
    # A turn with no failed attempt (the drain's) runs the plain form.
    return (
        """WITH v AS (
        SELECT r.id, r.fence, r.delay,
               (CAST(%(states)s AS varchar[]))[r.kind] AS state,
               (CAST(%(statuses)s AS integer[]))[r.kind] AS status,
               (CAST(%(errors)s AS text[]))[r.kind] AS error,
               (CAST(%(refunds)s AS integer[]))[r.kind] AS refund
        FROM unnest(
            CAST(%(ids)b AS bigint[]), CAST(%(fences)b AS bigint[]),
            CAST(%(kinds)b AS integer[]), CAST(%(delays)b AS float8[])
        ) AS r(id, fence, kind, delay)
    ), settled AS (
    UPDATE outbox_messages AS m SET"""
        + SETTLE_SET.format(m="m", now=f"COALESCE(%(now)s::float8, {STATEMENT_NOW})")
        + """FROM v
    WHERE"""
        + SETTLE_WHERE.format(m="m", owner="%(owner)s")
        # The leases the turn holds (a claim gives all its rows one lease_until): without
        # them the lease index would be walked whole, every relay's messages in flight, per
        # settle.
        + f""" AND m.lease_until = ANY(CAST(%(leases)b AS float8[]))
    RETURNING m.id
    ){FAILED_ATTEMPTS if recording else ""}
    SELECT CASE WHEN (SELECT count(*) FROM settled) = (SELECT count(*) FROM v)
        THEN '{{}}'::bigint[] ELSE ARRAY(SELECT id FROM v EXCEPT SELECT id FROM settled) END"""
    )


SETTLE_POSTGRESQL = settle_statement(recording=False)
SETTLE_RECORDING_POSTGRESQL = settle_statement(recording=True)


def settle(
    conn: Connection,
    owner: str,
    rows: Sequence[Settlement],
    now: Now,
    failures: Sequence[FailedAttempt] = (),
) -> set[int]:
    """Settle held messages in one statement, which records the turn's `failures` of the
    messages it changed; returns the ids it changed."""
    if not rows:
        return set()
    params = settle_parameters(owner, rows, now)
    dumping_numbers(conn)
    statement = SETTLE_POSTGRESQL
    if failures:
        statement = SETTLE_RECORDING_POSTGRESQL
        params |= {name: [getattr(f, field) for f in failures] for name, field in FAILURE_ARRAYS}
    # Planned per run: a generic plan may rescan the arrays once per row (see UNPREPARED).
    unsettled: list[int] = conn.exec_driver_sql(
        statement, params, execution_options={UNPREPARED: True}
    ).scalar_one()
    return set(params["ids"]).difference(unsettled)


FAILURE_ARRAYS = (
    ("failed_ids", "message_id"),
    ("failed_attempts", "attempt"),
    ("failed_states", "state"),
    ("failed_statuses", "status"),
    ("failed_errors", "error"),
)
"""(array parameter, FailedAttempt's field) of the recording form."""


def settle_parameters(owner: str, rows: Sequence[Settlement], now: Now) -> dict[str, Any]:
    """SETTLE_POSTGRESQL's parameters for `rows`, which name the leases they were claimed under."""
    leases = {row.lease_until for row in rows}
    if None in leases:
        # NULL matches no lease: the row would stay sending, be taken for lost and sent again.
        raise ValueError("a settlement without the lease it was claimed under")
    leases_held = [lease for lease in leases if lease is not None]
    kinds: dict[tuple[str, int | None, str | None, int], int] = {}
    row_kinds = [
        kinds.setdefault((row.state, row.status, row.error, row.refund), len(kinds) + 1)
        for row in rows
    ]
    states, statuses, errors, refunds = (list(column) for column in zip(*kinds, strict=True))
    return {
        "ids": BigInts([row.id for row in rows]),
        "fences": BigInts([row.fence for row in rows]),
        "kinds": Integers(row_kinds),
        "delays": Floats([row.delay for row in rows]),
        "states": states,
        "statuses": statuses,
        "errors": errors,
        "refunds": refunds,
        "leases": Floats(leases_held),
        "owner": owner,
        "now": now,
    }
