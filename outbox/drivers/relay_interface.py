"""The relay's part of the driver interface (outbox.drivers.base): its leases on messages,
its announcements and the figures its gauges read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from outbox.drivers.records import (
    ClaimedRow,
    FailedAttempt,
    FigureRow,
    KeyWalk,
    LastAnswers,
    LeaseState,
    Now,
    Settlement,
)


class RelayDriver(Protocol):
    """The relay's leases on messages: claim, adopt, settle, reap; its announcements and
    the figures its gauges read."""

    def claim_session(self) -> str | None:
        """The SQL that sets up the connection claims run on, or None."""
        ...

    def claim_messages(
        self,
        conn: Connection,
        *,
        owner: str,
        now: Now,
        lease: float,
        limit: int,
        budget: int,
        destinations: Sequence[str],
        skip_destinations: Sequence[str] = (),
        keys: KeyWalk | None = None,
    ) -> list[ClaimedRow]:
        """Lease up to `limit` due messages of `destinations` (none of `skip_destinations`):
        the oldest first, the first undelivered of each key and its key's next ones. `keys`:
        where this relay's claims walk ordering keys, moved by this claim."""
        ...

    def claim_chains(
        self, conn: Connection, heads: Sequence[ClaimedRow], params: dict[str, Any]
    ) -> list[ClaimedRow]:
        """Lease the next messages of the keys whose first messages `heads` just leased,
        with the claim's parameters."""
        ...

    def adopt_messages(
        self, conn: Connection, *, owner: str, now: Now, lease: float
    ) -> list[ClaimedRow]:
        """Re-lease `owner`'s messages still marked sending, under a new fence."""
        ...

    def reap_expired_message_leases(self, conn: Connection, now: Now, limit: int) -> int:
        """Return up to `limit` messages whose delivery lease expired to pending; how many."""
        ...

    def settle(
        self,
        conn: Connection,
        owner: str,
        rows: Sequence[Settlement],
        now: Now,
        failures: Sequence[FailedAttempt] = (),
    ) -> set[int]:
        """Settle `owner`'s held messages in one statement, fenced, recording the turn's
        `failures` of the messages it changed (in the same transaction); the ids it
        changed."""
        ...

    def lease_states(self, conn: Connection, ids: Sequence[int]) -> list[LeaseState]:
        """State, owner and fence of the messages among `ids`."""
        ...

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
        """Say that `owner` delivers `destinations` (and no others) for `lease` seconds,
        with its last `answers` from each."""
        ...

    def withdraw(self, conn: Connection, owner: str, now: Now = None) -> None:
        """`owner` delivers nothing any more: its announcements lapse `now`."""
        ...

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
        """Say that worker `owner` runs `handler` for the next `lease` seconds."""
        ...

    def withdraw_worker(self, conn: Connection, owner: str) -> None:
        """Worker `owner` stopped."""
        ...

    def destination_figures(self, conn: Connection, now: Now) -> list[FigureRow]:
        """Pending, sending and dead messages per destination, with the oldest's age."""
        ...

    def live_destinations(self, conn: Connection, now: Now) -> set[str]:
        """The destinations whose announcement has not lapsed."""
        ...

    def backlog_sample(
        self, conn: Connection, now: Now, destinations: Sequence[str]
    ) -> list[dict[str, Any]]:
        """This minute's backlog sample rows (every destination with undelivered messages,
        and each of `destinations`), or none when some relay has sampled the minute."""
        ...

    def record_backlog_sample(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Write a minute's sample rows (another relay's win), deleting samples past their
        keeping."""
        ...
