"""The console's lists of messages by state, in portable Core: each state walked in the
order of the index that holds it, a page at a time from a keyset, never by OFFSET.

    pending   by available_at (when due, the relay's claim order), ix_outbox_messages_deliverable
    sending   by lease_until (whose lease ends first), ix_outbox_messages_lease
    sent      by sent_at, ix_outbox_messages_sent
    dead      by id (creation), ix_outbox_messages_dead
    resolved  by id (creation), ix_outbox_messages_resolved

The id breaks ties, so a page ends on a (key, id) pair the next one starts after
(outbox.drivers.common.keysets). With a destination, the same walk keeps its rows.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.db.sql import state_literal
from outbox.drivers.common.keysets import keyset_page
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import ListedPage
from outbox.schema import messages
from outbox.states import MessageState

LISTED_BY: dict[str, sa.Column[Any]] = {
    MessageState.PENDING.value: messages.c.available_at,
    MessageState.SENDING.value: messages.c.lease_until,
    MessageState.SENT.value: messages.c.sent_at,
    MessageState.DEAD.value: messages.c.id,
    MessageState.RESOLVED.value: messages.c.id,
}
"""The column each state's list is in the order of."""

LISTED_FIELDS = (
    messages.c.id,
    messages.c.reply_id,
    messages.c.destination,
    messages.c.task_id,
    messages.c.ordering_key,
    messages.c.attempts,
    messages.c.last_status,
    messages.c.last_error,
    messages.c.created_at,
    messages.c.available_at,
    messages.c.lease_until,
    messages.c.sent_at,
    messages.c.resolved_at,
)
"""What a list shows of each message."""


def select_messages_in_state(page: ListedPage) -> sa.Select[Any]:
    """Up to page.limit messages in page.state, in its list's order (newest first if asked),
    after page.after (a (key, id) pair the previous page ended on)."""
    key = LISTED_BY[page.state]
    # The state written into the SQL: a generic plan can then use the state's partial index.
    query = sa.select(*LISTED_FIELDS, key.label("listed_key")).where(
        messages.c.state == state_literal(page.state)
    )
    if page.destination is not None:
        query = query.where(messages.c.destination == page.destination)
    return keyset_page(
        query, key, messages.c.id, newest=page.newest, after=page.after, limit=page.limit
    )


class MessageListStatements(DriverPieces):
    """The console's lists of messages by state."""

    def messages_in_state(self, conn: Connection, page: ListedPage) -> list[dict[str, Any]]:
        """One page of messages in a state (ListedPage says which, and after what), each with
        its `listed_key`, the value of the column the list is in the order of."""
        return [dict(row) for row in conn.execute(select_messages_in_state(page)).mappings()]
