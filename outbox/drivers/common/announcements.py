"""Who is running: relays announce the destinations they deliver (outbox_relays), with their
last answers from each, and workers announce themselves (outbox_workers), each with a lease."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import Now
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.records import NO_ANSWERS, LastAnswers, RelayRow, WorkerRow
from outbox.schema import relays, workers

HANDLER_SHOWN = 200
"""Characters of a handler's name a worker's announcement keeps (its column's length)."""
LAPSED_KEPT = 3600.0
"""Seconds a lapsed announcement (a relay or worker that died) is kept, for the console to
show it lapsed, before the next announcement of any relay or worker deletes it."""


@functools.cache
def announce_statement(pieces: DriverPieces) -> Any:
    """Upsert one (owner, destination) announcement valid for :lease seconds, with the
    relay's last answers from the destination; built once."""
    now = pieces.bound_now()

    def before(name: str) -> Any:
        # An age given as NULL (no such answer yet) makes the time NULL.
        return now - sa.bindparam(name, type_=sa.Double())

    answers = ["announced_at", "last_sent_at", "last_failed_at", "last_status", "last_error"]
    # A relay that restarts under the same name knows no answer yet: it keeps the ones its
    # row holds (a destination that was down must not look healthy) until it has its own.
    kept = {
        "last_sent_at": "last_sent_at",
        **dict.fromkeys(("last_failed_at", "last_status", "last_error"), "last_failed_at"),
    }
    statement = pieces.upsert(relays, ["owner", "destination"], ["expires_at", *answers], kept)
    return statement.values(
        owner=sa.bindparam("owner", type_=sa.String()),
        destination=sa.bindparam("destination", type_=sa.String()),
        expires_at=now + sa.bindparam("lease", type_=sa.Double()),
        announced_at=now,
        last_sent_at=before("sent_age"),
        last_failed_at=before("failed_age"),
        last_status=sa.bindparam("status", type_=sa.Integer()),
        last_error=sa.bindparam("error", type_=sa.Text()),
    )


@functools.cache
def announce_worker_statement(pieces: DriverPieces) -> Any:
    """Upsert one worker's announcement valid for :lease seconds; its start time is the
    first announcement's. Built once."""
    now = pieces.bound_now()
    return pieces.upsert(
        workers, ["owner"], ["handler", "concurrency", "announced_at", "expires_at"]
    ).values(
        owner=sa.bindparam("owner", type_=sa.String()),
        handler=sa.bindparam("handler", type_=sa.String()),
        concurrency=sa.bindparam("concurrency", type_=sa.Integer()),
        started_at=now,
        announced_at=now,
        expires_at=now + sa.bindparam("lease", type_=sa.Double()),
    )


class AnnouncementStatements(DriverPieces):
    """Relays announcing the destinations they deliver, workers announcing themselves, and
    both withdrawing; what the console reads of them."""

    def announce(
        self,
        conn: Connection,
        *,
        owner: str,
        destinations: Sequence[str],
        lease: float,
        now: Now,
        answers: Mapping[str, LastAnswers] | None = None,
    ) -> None:
        """Say that `owner` delivers `destinations` for the next `lease` seconds (and no
        others), with its last `answers` from each.

        Announcements that lapsed over LAPSED_KEPT ago (relays that died) are deleted on
        the way.
        """
        conn.execute(
            relays.delete().where(
                relays.c.owner == owner, relays.c.destination.not_in(destinations)
            )
        )
        self._forget_lapsed(conn, relays, now)
        given = answers or {}
        conn.execute(
            announce_statement(self),
            [
                {
                    "owner": owner,
                    "destination": d,
                    "lease": lease,
                    "now": now,
                    **given.get(d, NO_ANSWERS)._asdict(),
                }
                for d in destinations
            ],
        )

    def withdraw(self, conn: Connection, owner: str, now: Now = None) -> None:
        """`owner` delivers nothing any more (a relay stopping): its announcements lapse
        `now`, and are kept, with their last answers, as lapsed ones are."""
        lapsed = relays.update().where(
            relays.c.owner == owner, relays.c.expires_at > self.bound_now()
        )
        conn.execute(lapsed.values(expires_at=self.bound_now()), {"now": now})

    def announce_worker(
        self,
        conn: Connection,
        *,
        owner: str,
        handler: str,
        concurrency: int,
        lease: float,
        now: Now,
    ) -> None:
        """Say that worker `owner` runs `handler` for the next `lease` seconds; workers'
        announcements that lapsed over LAPSED_KEPT ago are deleted on the way."""
        self._forget_lapsed(conn, workers, now)
        conn.execute(
            announce_worker_statement(self),
            {
                "owner": owner,
                "handler": handler[:HANDLER_SHOWN],
                "concurrency": concurrency,
                "lease": lease,
                "now": now,
            },
        )

    def withdraw_worker(self, conn: Connection, owner: str) -> None:
        """Worker `owner` stopped."""
        conn.execute(workers.delete().where(workers.c.owner == owner))

    def relay_announcements(self, conn: Connection) -> list[RelayRow]:
        """Every relay's announcement of each destination, lapsed ones kept included."""
        columns = [relays.c[name] for name in RelayRow._fields]
        query = sa.select(*columns).order_by(relays.c.destination, relays.c.owner)
        return [RelayRow._make(row) for row in conn.execute(query)]

    def worker_announcements(self, conn: Connection) -> list[WorkerRow]:
        """Every worker's announcement, lapsed ones kept included."""
        columns = [workers.c[name] for name in WorkerRow._fields]
        query = sa.select(*columns).order_by(workers.c.owner)
        return [WorkerRow._make(row) for row in conn.execute(query)]

    def _forget_lapsed(self, conn: Connection, table: sa.Table, now: Now) -> None:
        """Delete `table`'s announcements that lapsed over LAPSED_KEPT ago."""
        kept: sa.BindParameter[float] = sa.bindparam("kept", LAPSED_KEPT, type_=sa.Double())
        lapsed = table.c.expires_at <= self.bound_now() - kept
        conn.execute(table.delete().where(lapsed), {"now": now})
