"""A worker says it is running: a row in outbox_workers, renewed at each heartbeat, deleted
at a clean stop, so the console can list the live workers and when each was last heard."""

from __future__ import annotations

import logging

from outbox.db.dialect import clock_value
from outbox.drivers import driver_for
from outbox.tasks import TaskQueue

log = logging.getLogger("outbox.worker")


class WorkerAnnouncements:
    """One worker's announcement: valid for its lease and a heartbeat more, so a worker whose
    heartbeats stop is shown lapsed a lease and a heartbeat after its last one."""

    def __init__(
        self, queue: TaskQueue, owner: str, handler: str, concurrency: int, heartbeat: float
    ) -> None:
        """Announce `owner` running `handler` on `concurrency` slots, on `queue`'s database."""
        self.queue = queue
        self.owner = owner
        self.handler = handler
        self.concurrency = concurrency
        self.valid_for = queue.lease + heartbeat
        self._driver = driver_for(queue.engine)

    def announce(self) -> None:
        """Renew the announcement; any error is logged, and the next beat tries again."""
        try:
            with self.queue.engine.begin() as conn:
                self._driver.announce_worker(
                    conn,
                    owner=self.owner,
                    handler=self.handler,
                    concurrency=self.concurrency,
                    lease=self.valid_for,
                    now=clock_value(self.queue.clock),
                )
        except Exception as exc:  # noqa: BLE001 - only the console's list depends on it
            # Whatever failed (the database, a pool checkout timing out), the heartbeat
            # thread that called it must go on renewing leases.
            log.warning("worker %s: could not announce itself (%s)", self.owner, exc)

    def withdraw(self) -> None:
        """Delete the announcement (a clean stop); any error leaves it to lapse."""
        try:
            with self.queue.engine.begin() as conn:
                self._driver.withdraw_worker(conn, self.owner)
        except Exception as exc:  # noqa: BLE001 - the stop goes on: the row lapses anyway
            log.warning("worker %s: could not withdraw its announcement (%s)", self.owner, exc)
