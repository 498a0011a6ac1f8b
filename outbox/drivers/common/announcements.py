"""Which relay delivers which destinations: announcements in outbox_relays, with a lease."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.schema import relays


@functools.cache
def announce_statement(pieces: DriverPieces) -> Any:
    """Upsert one (owner, destination) announcement valid for :lease seconds; built once."""
    now = pieces.bound_now()
    return pieces.upsert(relays, ["owner", "destination"], ["expires_at"]).values(
        owner=sa.bindparam("owner", type_=sa.String()),
        destination=sa.bindparam("destination", type_=sa.String()),
        expires_at=now + sa.bindparam("lease", type_=sa.Double()),
    )


class AnnouncementStatements(DriverPieces):
    """A relay announcing its destinations, and withdrawing them."""

    def announce(
        self,
        conn: Connection,
        *,
        owner: str,
        destinations: Sequence[str],
        lease: float,
        now: Now,
    ) -> None:
        """Say that `owner` delivers `destinations` for the next `lease` seconds (and no others).

        Lapsed announcements of any owner (relays that died) are deleted on the way.
        """
        conn.execute(
            relays.delete().where(
                relays.c.owner == owner, relays.c.destination.not_in(destinations)
            )
        )
        conn.execute(relays.delete().where(relays.c.expires_at <= self.bound_now()), {"now": now})
        conn.execute(
            announce_statement(self),
            [{"owner": owner, "destination": d, "lease": lease, "now": now} for d in destinations],
        )

    def withdraw(self, conn: Connection, owner: str) -> None:
        """`owner` delivers nothing any more (a relay stopping)."""
        conn.execute(relays.delete().where(relays.c.owner == owner))
