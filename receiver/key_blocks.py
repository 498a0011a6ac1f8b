"""Ordering keys a consumer holds back: each behind the first of its messages to be retried.

A key whose message ended ``retry`` is blocked by that message (by reply_id): a later
message of the key that arrives first is ``held``. The block ends when the blocking
message is settled for good (stored, duplicate, conflict or dead), or when it has not
come back for ``hold`` seconds. A message of a free key given back to the broker
unapplied blocks it too (see ``keep``). The blocks live in this process only.
"""

from __future__ import annotations

import logging

from receiver.outcomes import ACKNOWLEDGED, Outcome

log = logging.getLogger("outbox.receiver.consume")


class KeyBlocks:
    """Per ordering key, the reply_id to be applied first and until when it is waited for."""

    def __init__(self, hold: float) -> None:
        """Wait `hold` seconds for a blocking message to come back."""
        self.hold = hold
        self._blocked: dict[str, tuple[str, float]] = {}
        """Ordering key -> (reply_id of its message to be applied first, monotonic deadline)."""

    def blocker(self, key: str | None) -> str | None:
        """The reply_id `key` waits for, or None when it is free (or there is no key)."""
        if key is None:
            return None
        blocked = self._blocked.get(key)
        return None if blocked is None else blocked[0]

    def follow(self, key: str, reply_id: str, outcome: Outcome, now: float) -> None:
        """Block `key` by the first of its messages to be retried; unblock once it is settled."""
        if outcome == "retry":
            blocker = self._blocked.get(key)
            if blocker is None or blocker[0] == reply_id:
                self._blocked[key] = (reply_id, now + self.hold)
        elif outcome in ACKNOWLEDGED:
            self._unblock(key, reply_id)

    def keep(self, key: str, reply_id: str, now: float) -> None:
        """Block `key` by `reply_id`, given back to the broker, unless `key` is blocked already."""
        if key not in self._blocked:
            self._blocked[key] = (reply_id, now + self.hold)

    def _unblock(self, key: str | None, reply_id: str | None) -> None:
        """Unblock `key` if `reply_id` is the message it waits for."""
        if key is not None and self._blocked.get(key, ("", 0.0))[0] == reply_id:
            del self._blocked[key]

    def unblock_expired(self, now: float) -> None:
        """Give up waiting for failed messages that have not come back within `hold`."""
        for key, (reply_id, deadline) in list(self._blocked.items()):
            if deadline <= now:
                del self._blocked[key]
                log.warning(
                    "reply_id %s was not delivered again within %.0f s; the later messages "
                    "of its ordering key are no longer held back",
                    reply_id,
                    self.hold,
                    extra={"fields": {"reply_id": reply_id}},
                )
