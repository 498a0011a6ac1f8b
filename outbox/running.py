"""The tasks a worker holds: each claim with its stop event, and the slots they take.

A claim is held from the moment the producer leases it until the completer has
written its outcome (or the worker gives up on it). A held claim takes one of the
worker's `concurrency` slots from its claim until its handler returns: its result
then waits for the next group commit while the slot runs another task. The
producer claims into free slots, the heartbeat renews every held lease, the
executor runs the handler and gives the slot back, the completer marks a claim
written, and the drain waits for the held claims to end.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from outbox.claim import Claim

# A worker claims this share of `concurrency` ahead: a handler that returns is followed
# at once by a task already leased, not by a claim's round trip.
CLAIM_AHEAD = 0.5


# Guards the making of a claim's stop event, asked for by the loop and the heartbeat alike.
_MAKING_STOP = threading.Lock()


@dataclass
class Running:
    """One held claim, from its lease until its outcome is written or abandoned."""

    claim: Claim
    lost: bool = False  # set before `stop` is: the worker holds the task no more
    written: bool = False  # its outcome is committed: a refused renewal is no news
    # An async handler's own stop event, set from other threads through this function.
    async_stop: asyncio.Event | None = None
    set_async_stop: Callable[[], None] | None = None
    task: asyncio.Task[None] | None = None  # its task on the loop, to cancel it
    busy: bool = True  # holds one of `concurrency` slots (see RunningTasks.free_slots)
    # The trace context of the handler's run (outbox.tracing), its reply's creation context.
    reply_context: Mapping[str, str] | None = None
    _stop: threading.Event | None = field(default=None, repr=False)

    @property
    def stop(self) -> threading.Event:
        """Set when the handler should stop; made when first asked for.

        A plain handler is given it; an async handler's claim seldom needs it (its
        handler has `async_stop`), and an Event per task cost a busy worker a few
        percent of its CPU.
        """
        stop = self._stop
        if stop is None:
            with _MAKING_STOP:
                stop = self._stop
                if stop is None:
                    stop = self._stop = threading.Event()
        return stop

    @property
    def key(self) -> tuple[str, int]:
        """Each claim its own entry: a task lost and claimed again is held twice, briefly."""
        return (self.claim.task_id, self.claim.fence)

    def halt(self) -> None:
        """Tell the handler to stop (any thread)."""
        self.stop.set()
        if self.set_async_stop is not None:
            self.set_async_stop()


class RunningTasks:
    """The claims a worker holds, and the slots they take; any thread."""

    def __init__(self, concurrency: int, changed: Callable[[], None]) -> None:
        """`changed` is called whenever a slot frees (to wake the producer)."""
        self.concurrency = concurrency
        self._changed = changed
        self._held: dict[tuple[str, int], Running] = {}
        self._busy = 0  # entries of _held that hold a slot
        self._lock = threading.Lock()
        self.released = threading.Event()  # a held claim was let go: for the drain

    def __len__(self) -> int:
        """How many claims are held."""
        return len(self._held)

    def add(self, running: Running) -> None:
        """Hold a new claim in a slot."""
        with self._lock:
            self._held[running.key] = running
            self._busy += 1

    def held(self) -> list[Running]:
        """The claims held now."""
        with self._lock:
            return list(self._held.values())

    def free_slots(self) -> int:
        """Tasks to claim now.

        A slot (a plain handler's thread, or an async handler's turn) is free once
        the handler returns: its result waits for the next group commit while another
        task runs, since a turn spent waiting for a commit and then a claim would
        leave the slot idle. The worker also holds CLAIM_AHEAD of `concurrency`
        claimed and waiting for a slot (their leases renewed like the others'; given
        back unrun if the worker stops). All held leases, results waiting for their
        commit included, stay within 2.5 x `concurrency`, so a slow database stops
        the claims.
        """
        ahead = int(self.concurrency * CLAIM_AHEAD)
        with self._lock:
            return min(
                self.concurrency + ahead - self._busy,
                2 * self.concurrency + ahead - len(self._held),
            )

    def handler_returned(self, running: Running) -> None:
        """A handler is done: its slot may take the next task."""
        with self._lock:
            if not running.busy:
                return
            running.busy = False
            self._busy -= 1
        self._changed()

    def release(self, running: Running) -> None:
        """Let the claim go (its outcome is settled, or abandoned)."""
        with self._lock:
            if self._held.pop(running.key, None) is not None and running.busy:
                running.busy = False
                self._busy -= 1
        if not self.released.is_set():  # setting it again costs its lock and a notify
            self.released.set()
        self._changed()

    def abandon(self) -> list[Running]:
        """Mark every held claim lost and tell its handler to stop; those claims."""
        with self._lock:
            late = list(self._held.values())
            for running in late:
                # Heartbeats end now: another worker may take the task, so nothing of
                # this one's may be written any more.
                running.lost = True
                running.halt()
        return late
