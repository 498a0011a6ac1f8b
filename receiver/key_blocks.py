"""Ordering keys a consumer holds back: each behind the first of its messages to be retried.

A key whose message ended ``retry`` is blocked by that message (by reply_id): a later
message of the key that arrives first is ``held``. Every message of a key given back to
the broker unapplied (``retry`` or ``held``) waits, in the order this consumer first saw
them, which is the key's order (a broker first delivers a key's messages in the order
the relay published them; it may deliver them again in any order). When the blocking
message is settled for good (stored, duplicate, conflict or dead), the key's first
waiting message blocks it in turn, so the broker handing over a later one first changes
nothing. A message not given back again for ``hold`` seconds (another consumer took it,
or the broker gave up on it) is no longer waited for: the next waiting one seen since
blocks the key, or the key is free. The blocks live in this process only.
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
        self._waiting: dict[str, dict[str, float]] = {}
        """Ordering key -> its messages given back unapplied: reply_id -> when last given
        back, in the order first seen."""

    def blocker(self, key: str | None) -> str | None:
        """The reply_id `key` waits for, or None when it is free (or there is no key)."""
        if key is None:
            return None
        blocked = self._blocked.get(key)
        return None if blocked is None else blocked[0]

    def follow(self, key: str, reply_id: str, outcome: Outcome, now: float) -> None:
        """Block `key` by the first of its messages to be retried; once the blocking one is
        settled, pass the block on to the key's first waiting message."""
        if outcome == "retry":
            blocker = self._blocked.get(key)
            if blocker is None or blocker[0] == reply_id:
                self._blocked[key] = (reply_id, now + self.hold)
        elif outcome in ACKNOWLEDGED:
            self._waiting.get(key, {}).pop(reply_id, None)
            if self._blocked.get(key, ("", 0.0))[0] == reply_id:
                del self._blocked[key]
                self._pass_on(key)

    def keep(self, key: str, reply_id: str, now: float) -> None:
        """Note `reply_id`, given back to the broker unapplied now, among `key`'s waiting
        messages; block a free `key` by the first of them."""
        waiting = self._waiting.setdefault(key, {})
        waiting[reply_id] = now  # a reply_id seen before keeps its place
        if key not in self._blocked:
            self._pass_on(key)

    def _pass_on(self, key: str) -> None:
        """Block the free `key` by its first waiting message, waited for `hold` from when it
        was last given back; forget the key when none waits."""
        waiting = self._waiting.get(key)
        if not waiting:
            self._waiting.pop(key, None)
            return
        first, given_back = next(iter(waiting.items()))
        self._blocked[key] = (first, given_back + self.hold)

    def unblock_expired(self, now: float) -> None:
        """Give up waiting for messages that have not come back within `hold`: the key's
        next waiting message seen since blocks it instead, or the key is free."""
        for key, (reply_id, deadline) in list(self._blocked.items()):
            if deadline > now:
                continue
            del self._blocked[key]
            waiting = self._waiting.get(key, {})
            for gone in [r for r, seen in waiting.items() if seen + self.hold <= now]:
                del waiting[gone]
            waiting.pop(reply_id, None)
            self._pass_on(key)
            log.warning(
                "reply_id %s was not delivered again within %.0f s; the later messages "
                "of its ordering key are no longer held back for it",
                reply_id,
                self.hold,
                extra={"fields": {"reply_id": reply_id}},
            )
