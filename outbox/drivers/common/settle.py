"""The relay's settle, whose statements are each backend's own, and the read that resolves
an uncertain one.

Settling is one guarded statement for the whole turn: each row is matched by its
(id, fence) pair, the state `sending` and the owner, so a stale relay's write touches
nothing. The SET and WHERE both backends' statements share are here.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import LeaseState
from outbox.schema import messages

# Every outcome of a turn settles in ONE statement. A turn's outcomes are mostly alike,
# so the rows carry (id, fence, kind, delay) and each distinct kind (state, status,
# error, refund) travels once: numeric arrays are cheap to send, and the SQL text stays
# the same whatever the batch size. SQLite gets the rows as one JSON document.
SETTLE_SET = """
    state = v.state,
    lease_until = NULL,
    attempts = {m}.attempts - v.refund,
    last_status = v.status,
    last_error = v.error,
    sent_at = CASE WHEN v.state = 'sent' THEN {now} ELSE {m}.sent_at END,
    available_at = CASE WHEN v.state = 'pending' THEN {now} + v.delay ELSE {m}.available_at END
"""
SETTLE_WHERE = """
    {m}.id = v.id AND {m}.fence = v.fence AND {m}.state = 'sending' AND {m}.owner = {owner}
"""


def select_lease_states(ids: Sequence[int]) -> sa.Select[tuple[int, str, str | None, int]]:
    """Re-read state, owner and fence of messages (to resolve an uncertain commit)."""
    return sa.select(messages.c.id, messages.c.state, messages.c.owner, messages.c.fence).where(
        messages.c.id.in_(list(ids))
    )


class SettleReads(DriverPieces):
    """What settling reads back: the leases the database holds."""

    def lease_states(self, conn: Connection, ids: Sequence[int]) -> list[LeaseState]:
        """State, owner and fence of the messages among `ids` (a settle retried after its
        COMMIT raised finds what an earlier try did)."""
        return [LeaseState._make(row) for row in conn.execute(select_lease_states(ids))]
