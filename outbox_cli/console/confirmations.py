"""The confirmation a forced requeue must carry: issued with the refusal it overrides."""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from outbox.clock import Clock

CONFIRM_SECONDS = 600.0
"""How long a forced requeue's confirmation lasts after the refusal that issued it."""
CONFIRMATIONS = 1_024
"""Confirmations held at most; past that the oldest is forgotten (its force refused)."""


@dataclass(frozen=True)
class Confirmation:
    """What a refusal offered to override: the lookup's answer it refused on, the reason
    the operator gave, and the secret that confirms it until `expires`."""

    token: str
    receipt: str
    reason: str
    expires: float
    ids: tuple[int, ...] = ()
    """The messages a bulk decision's count found, which its confirmation decides about."""


class Confirmations:
    """The confirmations a forced requeue needs, each issued with the refusal it overrides.

    Held by this process, not signed into the form: each is used once, which a signature
    alone could not promise without a record of the used ones anyway. Each is held under
    the session that saw the refusal and the reply it names, so a token shown to one
    session or for one reply confirms nothing else; a newer refusal replaces the older
    one's confirmation; any attempt to use one consumes it.
    """

    def __init__(
        self, clock: Clock, seconds: float = CONFIRM_SECONDS, held: int = CONFIRMATIONS
    ) -> None:
        """Confirmations that last `seconds` on `clock`, `held` of them at most."""
        self.clock = clock
        self.seconds = seconds
        self.most = held
        self.held: OrderedDict[tuple[str, str], Confirmation] = OrderedDict()
        """Per (session, reply_id) the confirmation issued last, the oldest first."""

    def issue(
        self, session: str, reply_id: str, receipt: str, reason: str, ids: tuple[int, ...] = ()
    ) -> str:
        """A new confirmation of forcing `reply_id`'s requeue past `receipt`, for `session`
        (or of a bulk decision, `reply_id` naming it, about the messages `ids`)."""
        now = self.clock()
        for key in [key for key, held in self.held.items() if held.expires <= now]:
            del self.held[key]
        token = secrets.token_urlsafe(32)
        self.held.pop((session, reply_id), None)
        held = Confirmation(token, receipt, reason, now + self.seconds, ids)
        self.held[(session, reply_id)] = held
        while len(self.held) > self.most:
            self.held.popitem(last=False)
        return token

    def redeem(self, session: str, reply_id: str, offered: str) -> Confirmation | None:
        """The confirmation `offered` is, if it was issued to `session` for `reply_id` and has
        neither expired nor been used; None otherwise. Either way it is used up."""
        held = self.held.pop((session, reply_id), None)
        if held is None or not hmac.compare_digest(held.token.encode(), offered.encode()):
            return None
        return held if self.clock() < held.expires else None
