"""Task leases renewed: the lease a claim still holds in portable Core, and the SQL both
backends' one-statement renewals of many leases share."""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.task_transitions import held_guard, holding
from outbox.drivers.task_interface import Held
from outbox.schema import tasks

# A heartbeat renews every lease a worker holds in one statement: each row matched by
# (task_id, owner, fence) and the held guard (held_in_v), as a finish is.
RENEW_SET = "lease_until = {now} + {lease}, updated_at = {now}"
"""The renewal's SET clause."""


@functools.cache
def held_lease_statement(pieces: DriverPieces) -> sa.Select[Any]:
    """lease_until of :held_task while :holder still holds it under :held_fence, else no row."""
    return sa.select(tasks.c.lease_until).where(held_guard(pieces.bound_now()))


class TaskRenewalStatements(DriverPieces):
    """TaskRenewalsDriver: the held lease in Core; each backend renews many in its own SQL."""

    @abstractmethod
    def renew_leases(
        self, conn: Connection, held: Sequence[Held], lease: float, now: float | None
    ) -> dict[Held, float]:
        """Extend by `lease` each of `held` that still holds, in one statement: the new
        lease_until of each extended. A row locked by a write under way may be skipped."""

    def held_lease(self, conn: Connection, held: Held, now: float | None) -> float | None:
        """lease_until of a task while `held` still holds it, else None."""
        until = conn.execute(held_lease_statement(self), holding(held, now)).scalar()
        return None if until is None else float(until)


def renewed(rows: Any) -> dict[Held, float]:
    """The renewals' rows (task_id, owner, fence, lease_until), by held triple."""
    return {
        (str(task_id), str(owner), int(fence)): float(until)
        for task_id, owner, fence, until in rows
    }
