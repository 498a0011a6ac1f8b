"""The pull requests a JetStream consumer makes on its own inbox, and what they bring.

The pull requests are made here, not by nats-py's ``fetch``: it takes any message with
a ``Status`` header for the server's own status message, and drops it (never acked nor
terminated: redelivered for ever) or fails on it, while anyone who may publish to the
stream can set that header. Here a message is a delivery of the stream when it comes
with a ``$JS.ACK`` reply subject, whatever its headers, and is checked, settled and
counted like any other; only a message without one, on the request's own inbox, is the
server's status (404 no messages, 408 request ended, 409, 503 no consumer).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import TYPE_CHECKING

from receiver.deliveries import lowercased
from receiver.stoppable import Stoppable

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

FETCH_WAIT = 1.0
"""Seconds one pull request waits for a message when none is at hand."""
ANSWER_GRACE = 2.0
"""Seconds past its own end a pull request's answer may take before it counts as lost (a
reconnect drops the server's side of it): the next turn asks again."""
ACK_PREFIX = "$JS.ACK."
"""How the reply subject of every JetStream delivery begins; a server status has none."""
ENDS_REQUEST = frozenset({"404", "408", "409"})
"""Statuses that end a pull request: nothing left, its time is up, or it was refused."""

log = logging.getLogger("outbox.receiver.consume")


class PullRequests:
    """One durable's pull requests on one inbox, and the deliveries they brought."""

    def __init__(self, stream: str, durable: str, batch: int, stopper: Stoppable) -> None:
        """Pull up to `batch` messages at a time of `durable` on `stream`; `stopper`'s stop
        ends a wait for an answer."""
        self.stream = stream
        self.durable = durable
        self.batch = batch
        self._stopper = stopper
        self._arrived: list[Msg] = []
        """Deliveries received and not yet taken into a batch."""
        self._ended: set[str] = set()
        """Pull requests (their reply subjects) the server said are over."""
        self._news = asyncio.Event()
        self._requests = itertools.count()

    def left_over(self) -> list[Msg]:
        """The deliveries that arrived after the last batch was taken; none are kept."""
        left, self._arrived = self._arrived, []
        return left

    async def pull(self, client: Client, inbox: str) -> list[Msg]:
        """Up to a batch of deliveries: those at hand, else what the stream has now, else
        the first to come within FETCH_WAIT and whatever the stream has then."""
        if self._arrived:
            return self._take()
        # Each request ends on its own: a no_wait one once the stream has nothing more
        # (404, or 408 after some), a waiting one of one message with it or at its expiry.
        # A waiting request for a whole batch would hold its first message until the
        # batch fills or the request expires.
        await self._request(client, inbox, {"batch": self.batch, "no_wait": True}, 0.0)
        if not self._arrived:
            expires = int(FETCH_WAIT * 1e9)
            await self._request(client, inbox, {"batch": 1, "expires": expires}, FETCH_WAIT)
            if self._arrived and self.batch > 1:
                more = {"batch": self.batch - 1, "no_wait": True}
                await self._request(client, inbox, more, 0.0)
        return self._take()

    def _take(self) -> list[Msg]:
        """The deliveries at hand, up to a batch, in arrival order."""
        taken, self._arrived = self._arrived[: self.batch], self._arrived[self.batch :]
        return taken

    async def _request(
        self, client: Client, inbox: str, request: dict[str, int | bool], lasts: float
    ) -> None:
        """Make one pull request; return once it is answered in full, ended by the server,
        lost (no end within `lasts` + ANSWER_GRACE seconds), or stop() is called."""
        reply = f"{inbox}.{next(self._requests)}"
        wanted = len(self._arrived) + int(request["batch"])
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
        await client.publish(subject, json.dumps(request).encode(), reply=reply)
        deadline = time.monotonic() + lasts + ANSWER_GRACE
        stop = asyncio.ensure_future(self._stopper.wait_stopped())
        try:
            while reply not in self._ended and len(self._arrived) < wanted:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopper.stopping:
                    # Deliveries it may still bring are taken by a later turn.
                    log.debug("pull request %s had no end in time", reply)
                    return
                self._news.clear()
                news = asyncio.ensure_future(self._news.wait())
                await asyncio.wait({news, stop}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                news.cancel()
        finally:
            stop.cancel()
            self._ended.discard(reply)

    async def receive(self, message: Msg) -> None:
        """Every message on the pull requests' inbox: a delivery, or the server's status."""
        if message.reply.startswith(ACK_PREFIX):
            # A delivery of the stream, whatever its headers say (a Status among them):
            # checked and settled like any other.
            self._arrived.append(message)
        else:
            # nats-py keys an inline status's description by an enum: lowercased makes
            # every name plain text.
            headers = lowercased(message.headers)
            status, described = headers.get("status", ""), headers.get("description", "")
            if status in ENDS_REQUEST:
                self._ended.add(message.subject)
                if status == "409":
                    # The request was refused (too many waiting, the durable deleted...).
                    log.warning("NATS ended a pull request: %s %s", status, described)
            elif status == "503":
                self._ended.add(message.subject)
                log.warning("NATS: no durable %s on stream %s answers", self.durable, self.stream)
            else:
                # Not a JetStream delivery nor a status that concerns us: someone else
                # published to this inbox. Nothing to settle.
                log.warning(
                    "ignored a message on the consumer's inbox that is not a JetStream "
                    "delivery (status %r)",
                    status[:20],
                )
        self._news.set()
