"""PostgreSQL's reap of expired message leases: one statement that also records them.

Reaping runs in autocommit beside the claim (outbox.db.dialect.one_statement): the
reaped messages' failed attempts are written by the same statement, in a CTE, so a relay
stopping between two statements cannot leave a reaped attempt unrecorded.
"""

from __future__ import annotations

import functools

import sqlalchemy as sa

from outbox.drivers.common.failed_attempts import RECORDED, expired_attempt
from outbox.drivers.common.leases import reap_statement
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import failed_attempts, messages


@functools.cache
def reap_recording_statement(pieces: DriverPieces) -> sa.Insert:
    """Reap up to :limit expired leases (the portable reap) and record each as a failed
    attempt; returns a row per message reaped. Built once."""
    reaped = reap_statement(pieces).returning(messages.c.attempts).cte("reaped")
    recorded = expired_attempt(reaped.c.id, reaped.c.attempts, pieces.bound_now())
    # A data-modifying CTE must sit at the top of the statement: add_cte puts it there.
    return (
        sa.insert(failed_attempts)
        .add_cte(reaped)
        .from_select(RECORDED, recorded)
        .returning(failed_attempts.c.message_id)
    )
