"""The limit on wrong console tokens per client address (GuessLimit).

Wrong tokens, at the login form or as a bearer, are counted per client address: after
GUESSES, 429 until one is earned back.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict

from starlette.responses import PlainTextResponse, Response

from outbox.clock import Clock

GUESSES = 10
"""Wrong tokens a client address may offer in a row before it must wait."""
GUESS_SECONDS = 6.0
"""How often a client address earns back one wrong token: ten a minute, sustained."""
GUESSERS = 4_096
"""Client addresses whose wrong tokens are remembered; past that the longest quiet is
forgotten, so that many addresses cannot fill the console's memory."""


class GuessLimit:
    """Wrong tokens per client address, each address a token bucket GUESSES deep that
    refills one every GUESS_SECONDS; an empty bucket's next try is refused unchecked."""

    def __init__(
        self,
        clock: Clock = time.monotonic,
        guesses: int = GUESSES,
        seconds: float = GUESS_SECONDS,
        remembered: int = GUESSERS,
    ) -> None:
        """Buckets of `guesses`, refilled one per `seconds` on `clock`, for `remembered`
        addresses at most."""
        self.clock = clock
        self.guesses = guesses
        self.seconds = seconds
        self.remembered = remembered
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """Per address: the guesses left, and when that was counted; the least recently
        refused first."""

    def _left(self, address: str, now: float) -> float:
        """The guesses `address` has left at `now`."""
        left, counted = self.buckets.get(address, (float(self.guesses), now))
        return min(float(self.guesses), left + max(0.0, now - counted) / self.seconds)

    def wait(self, client: str) -> int:
        """Whole seconds before `client` may offer a token again (0: now)."""
        left = self._left(guesser(client), self.clock())
        return 0 if left >= 1 else max(1, math.ceil((1 - left) * self.seconds))

    def wrong(self, client: str) -> None:
        """Count a wrong token offered by `client`."""
        address, now = guesser(client), self.clock()
        left = self._left(address, now) - 1
        self.buckets.pop(address, None)
        self.buckets[address] = (left, now)
        while len(self.buckets) > self.remembered:
            self.buckets.popitem(last=False)


def guesser(client: str) -> str:
    """Who a client address's guesses count against: the address, or an IPv6 address's
    /64 (one host is given a whole /64 to pick addresses from)."""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client
    if address.version == 6 and address.ipv4_mapped is not None:
        # An IPv4 client of a dual-stack socket: its own address, not the /64 of them all.
        return str(address.ipv4_mapped)
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def too_many_guesses(wait: int) -> Response:
    """429 for a client that offered too many wrong tokens; Retry-After says when to retry."""
    return PlainTextResponse(
        f"429: too many wrong tokens; try again in {wait} s", 429, {"Retry-After": str(wait)}
    )
