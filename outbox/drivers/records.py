"""The relay's typed rows the drivers return and take, and the key walk a claim goes on.

In the core so that both the drivers and the relay (relay.records re-exports them) can
name them: the relay owns the KeyWalk it passes to each claim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple

Now = float | None
"""A manual clock's time, or None for the database's clock (a parameter of the drivers'
statements; outbox.drivers.base names it too)."""


class ClaimedRow(NamedTuple):
    """A row as a claim returns it: the message's columns and its attempts before the claim.

    When `previous_attempts` is already the budget, the message was reclaimed after
    a lease expired mid-send and may only be resolved, never sent again.
    """

    id: int
    reply_id: str
    destination: str
    body: bytes
    content_hash: str
    headers: str
    attempts: int
    fence: int
    ordering_key: str | None
    lease_until: float
    previous_attempts: int


class FailedAttempt(NamedTuple):
    """A delivery attempt of a turn that did not end in a delivery, as its settle records it
    (outbox_failed_attempts) when the message settles: its count, where the attempt's
    answer sent it (pending for a retry, or dead), and that answer."""

    message_id: int
    attempt: int
    state: str
    status: int | None
    error: str | None


class Settlement(NamedTuple):
    """How one message's turn ends, written in the turn's one settling statement."""

    id: int
    fence: int
    state: str
    status: int | None
    error: str | None
    delay: float
    """Seconds before the next attempt (pending only)."""
    refund: int
    """Attempts to give back: 1 when the claim counted an attempt that was never made."""
    lease_until: float | None
    """The message's lease, as claimed: the settle finds its rows by it."""


class LeaseState(NamedTuple):
    """What the database holds of a message's lease: read to resolve an uncertain commit."""

    id: int
    state: str
    owner: str | None
    fence: int


class FigureRow(NamedTuple):
    """One destination's messages in one state: how many, and the oldest's age (None: dead)."""

    destination: str
    state: str
    number: int
    """How many messages (`count` is a tuple's method)."""
    age: float | None


class LastAnswers(NamedTuple):
    """A relay's last answers from one destination, as it announces them: how long before
    the announcement its last accepted delivery and its last failed attempt were (None:
    none since it started), and that failure's status (None: no answer) and error."""

    sent_age: float | None
    failed_age: float | None
    status: int | None
    error: str | None


NO_ANSWERS = LastAnswers(None, None, None, None)
"""A destination this relay has had no answer from yet."""


class RelayRow(NamedTuple):
    """One relay's announcement of one destination, as the console reads it."""

    owner: str
    destination: str
    expires_at: float
    announced_at: float | None
    """None: announced by a relay older than migration o0014."""
    last_sent_at: float | None
    last_failed_at: float | None
    last_status: int | None
    last_error: str | None


class WorkerRow(NamedTuple):
    """One worker's announcement, as the console reads it."""

    owner: str
    handler: str
    concurrency: int
    started_at: float
    announced_at: float
    expires_at: float


class ListedPage(NamedTuple):
    """Which page of a list of messages in one state: after the (key, id) the previous page
    ended on (None: the first page), newest first or oldest first."""

    state: str
    destination: str | None = None
    newest: bool = False
    after: tuple[float, int] | None = None
    limit: int = 51


class ListedTasks(NamedTuple):
    """Which page of a list of tasks in one state: after the (key, task_id) the previous
    page ended on (None: the first page), newest first or oldest first."""

    state: str
    tenant: str | None = None
    newest: bool = False
    after: tuple[float, str] | None = None
    limit: int = 51


AuditKind = Literal["reply", "task"]
"""What an audited decision is about: a dead reply (requeue, resolve) or a task (cancel)."""

AUDIT_KINDS: tuple[AuditKind, ...] = ("reply", "task")
"""Every kind: what the audit page lists unless told one."""


class AuditedPage(NamedTuple):
    """Which page of the audit: the decisions of `kinds`, of operator `by` (None: anyone's),
    each kind's before the id its previous page ended on (None: from its newest), at most
    `limit` of each kind."""

    kinds: tuple[AuditKind, ...] = AUDIT_KINDS
    by: str | None = None
    reply_before: int | None = None
    task_before: int | None = None
    limit: int = 51


KEY_WALK = 2
"""A claim visits at most this many keys of a destination per first message it may take;
the next claim goes on from where it stopped (KeyWalk's cursor), and from the first key
once it passes the last, so every key is reached within a bounded number of claims."""
FIRST_HEADS = 8
"""How many first messages a relay's first walk may take (KeyWalk.heads at the start)."""
# Few: a first claim that took every key of a backlog of long keys held them all for its
# turn, while every other claim, of its pipeline or of another relay, found none to take.
# Short keys lose nothing by it: the claim walks on for more keys in further rounds
# (outbox.drivers.postgresql.claims.KEY_ROUNDS), and the bound doubles at each claim.


@dataclasses.dataclass
class KeyWalk:
    """Where a relay's claims walk a destination's keys, from claim to claim (PostgreSQL;
    MySQL uses the cursors alone).

    `cursors`: per destination, the last key the previous walk reached; the next walk
    goes on after it. `heads`: how many first messages a walk may take (FIRST_HEADS
    at first), None for the claim's limit. A claim whose keys' chains alone filled the
    room its first messages left sets it to half the keys it took: the keys are long,
    and fewer of them a claim leave the others to the next claim, of this relay's
    pipeline or of another relay, so that several turns deliver keyed messages at once
    instead of one turn holding every key. Any other claim that took as many keys as it
    could doubles it again (up to the limit).
    """

    cursors: dict[str, str] = dataclasses.field(default_factory=dict)
    heads: int | None = FIRST_HEADS

    def after_claim(self, limit: int, heads: Sequence[ClaimedRow], chained: int) -> None:
        """Adjust `heads` to a claim of `limit` that took `heads` and `chained` successors."""
        keyed = sum(1 for h in heads if h.ordering_key is not None)
        if not keyed:
            return
        taking = min(self.heads or limit, limit)
        room = limit - len(heads)
        if room > 0 and chained >= room:
            # Half the keys taken, not half the walk's bound: with fewer keys than the
            # bound, halving the bound took every key again, one whole turn per halving,
            # while no other claim found a key to take.
            self.heads = max(1, min(taking, keyed) // 2)
        elif keyed >= taking:
            # Room left, or none left to chain into (other messages filled the claim): the
            # keys were not what crowded it, so the next walk may take more of them. Never
            # left low while unkeyed messages fill the claims.
            self.heads = min(limit, taking * 2)
        # Otherwise the walk found fewer keys than it could take: the bound held nothing
        # back, and stays. Raised there, at the tail of a backlog of long keys, it let the
        # next backlog's first claims take every key again.
