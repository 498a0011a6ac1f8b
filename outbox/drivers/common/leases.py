"""The relay's leases on messages besides the claim: adopting its own, reaping expired ones."""

from __future__ import annotations

import functools

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import limit_parameter, picked_once, state_literal
from outbox.drivers.base import Now
from outbox.drivers.common.claims import CLAIMED
from outbox.drivers.common.failed_attempts import record_expired
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import ClaimedRow
from outbox.schema import messages
from outbox.states import MessageState


@functools.cache
def adopt_statement(pieces: DriverPieces) -> sa.Update:
    """Re-lease :claim_owner's sending messages under a new fence; built once."""
    now = pieces.bound_now()
    return (
        sa.update(messages)
        .where(
            messages.c.state == state_literal(MessageState.SENDING),
            messages.c.owner == sa.bindparam("claim_owner", type_=sa.String()),
        )
        .values(
            lease_until=now + sa.bindparam("lease", type_=sa.Double()), fence=messages.c.fence + 1
        )
        .returning(*CLAIMED, (messages.c.attempts - 1).label("previous_attempts"))
    )


@functools.cache
def reap_statement(pieces: DriverPieces) -> sa.Update:
    """Return up to :limit messages whose delivery lease expired to pending; the relay then
    decides their fate."""
    now = pieces.bound_now()
    pick = messages.alias("pick")
    chosen = (
        sa.select(pick.c.id)
        .where(pick.c.state == state_literal(MessageState.SENDING), pick.c.lease_until <= now)
        .limit(limit_parameter())
    )
    return (
        sa.update(messages)
        .where(
            messages.c.id.in_(picked_once(chosen, pieces.supports_skip_locked)),
            messages.c.state == state_literal(MessageState.SENDING),
        )
        .values(
            state=MessageState.PENDING.value,
            lease_until=None,
            available_at=now,
            last_error="lease expired",
        )
        .returning(messages.c.id)
    )


class LeaseStatements(DriverPieces):
    """Adopting a relay's own leases, and reaping expired ones."""

    def adopt_messages(
        self, conn: Connection, *, owner: str, now: Now, lease: float
    ) -> list[ClaimedRow]:
        """Re-lease this owner's messages still marked sending, under a new fence.

        Run only after a claim whose COMMIT raised, with no turn of this relay in
        flight, so such rows were leased by that claim. Their counted attempt is the
        one about to be made. Rows are shaped as claim_messages returns them.
        """
        params = {"now": now, "claim_owner": owner, "lease": lease}
        return [ClaimedRow._make(row) for row in conn.execute(adopt_statement(self), params)]

    def reap_expired_message_leases(self, conn: Connection, now: Now, limit: int) -> int:
        """Return up to `limit` messages whose delivery lease expired to pending; how many."""
        reaped = conn.execute(reap_statement(self), {"now": now, "limit": limit}).scalars().all()
        if reaped:
            conn.execute(record_expired(reaped, self.now_sql(now)))
        return len(reaped)
