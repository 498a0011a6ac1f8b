"""Header names a message may not carry, each reserved by the system that reads it.

A delivery system that treats some header names as its own would act on a message's
header of that name (drop the message, switch off a check) instead of passing it on.
publish() refuses such names (outbox.messages.check_headers), so the publisher hears of
it when it calls publish(), not when the message dies at the relay; the service that
publishes imports the core alone, never the relay, so the reservations are declared here
as data. Each entry names who reserves the names and why; the transport concerned reads
its entries from here too (relay.transports.nats, for messages stored before a
reservation existed), so a reservation has this one home.
"""

from __future__ import annotations

from typing import NamedTuple


class Reservation(NamedTuple):
    """Header names one delivery system reads as its own, and the refusal publish() gives."""

    names: frozenset[str]
    """Reserved names, lowercase (header names are case-insensitive)."""
    prefixes: tuple[str, ...]
    """Reserved beginnings of names, lowercase."""
    refusal: str
    """What InvalidMessage says; `{name}` stands for the header's name, quoted."""

    def refuse(self, name: str) -> str:
        """The refusal of a header called `name`."""
        return self.refusal.format(name=repr(name))

    def covers(self, name: str) -> bool:
        """Whether `name` (any case) is one of these names or begins with these prefixes."""
        lowered = name.lower()
        return lowered in self.names or lowered.startswith(self.prefixes)


RELAY = Reservation(
    names=frozenset(
        {
            "content-type",
            "content-length",
            "host",
            "webhook-id",
            "webhook-timestamp",
            "webhook-signature",
            "outbox-content-hash",
            # A broker consumer orders by it: only the message's own ordering key may set it.
            "outbox-ordering-key",
        }
    ),
    prefixes=(),
    refusal="header {name} is set by the relay",
)
"""What the relay itself sends with every message: the request's framing, the signature."""

NATS_JETSTREAM = Reservation(
    names=frozenset(),
    prefixes=("nats-",),
    refusal=(
        "header {name}: names beginning 'nats-' are NATS JetStream's own "
        "(its dedupe and stream checks)"
    ),
)
"""JetStream reads Nats-* headers (Nats-Msg-Id, Nats-Expected-*, Nats-Rollup): a message's
own could switch off the stream's dedupe or change what it stores."""

NATS_STATUS = Reservation(
    names=frozenset({"status", "description"}),
    prefixes=(),
    refusal="header {name}: NATS clients read it as a server status, not as a header",
)
"""nats-py reads a message with a Status header as the server's control message: a fetch
drops it or fails on it, so a consumer would never see it (nor anything behind it)."""

NATS = (NATS_JETSTREAM, NATS_STATUS)
"""The reservations a NATS destination dies on when a stored message breaks them."""

RESERVATIONS = (RELAY, *NATS)
"""Every reservation publish() checks, in the order it checks them."""


def reservation_of(name: str) -> Reservation | None:
    """The reservation `name` falls under, or None when a message may carry it."""
    for reservation in RESERVATIONS:
        if reservation.covers(name):
            return reservation
    return None
