"""The relay's typed records: a claimed message, and the settlement of one.

The rows the driver returns and takes (ClaimedRow, Settlement, FailedAttempt) are the core's
(outbox.drivers.records), named here too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from outbox.drivers.records import ClaimedRow, FailedAttempt, Settlement

_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class Message(NamedTuple):
    """A claimed message: what to send and the lease it was claimed under."""

    id: int
    reply_id: str
    destination: str
    body: bytes
    content_hash: str
    headers: Mapping[str, str]
    attempts: int
    fence: int
    ordering_key: str | None = None
    """Broker transports render it into a subject or routing key template."""
    lease_until: float | None = None
    """When the lease this message was claimed under ends (its settle names it)."""

    @classmethod
    def from_row(cls, row: ClaimedRow) -> Message:
        """A message from a claimed row, whose first fields are a message's, in order."""
        headers = row.headers
        if headers == "{}" and type(row.body) is bytes:
            # The usual row: its fields as they are, in one call rather than one per field
            # (tests/relay/test_relay_settle_statement.py holds the two field lists together).
            return cls._make((*row[:5], _NO_HEADERS, *row[6:10]))
        # Positional arguments in the field order: keywords cost more per row.
        return cls(
            row.id,
            row.reply_id,
            row.destination,
            bytes(row.body),
            row.content_hash,
            # Most messages have no headers: skip decoding the same "{}" for every row.
            _NO_HEADERS if headers == "{}" else json.loads(headers),
            row.attempts,
            row.fence,
            row.ordering_key,
            row.lease_until,
        )


def key_chains(messages: Sequence[Message]) -> list[list[Message]]:
    """Each unkeyed message alone, and each key's messages together (a chain), in the
    order given: what every transport keeps in order and stops at its first failure."""
    chains: list[list[Message]] = []
    keyed: dict[str, list[Message]] = {}
    for message in messages:
        key = message.ordering_key
        if key is None:
            chains.append([message])
        elif key in keyed:
            keyed[key].append(message)
        else:
            keyed[key] = chain = [message]
            chains.append(chain)
    return chains


def repeats_a_key(messages: Sequence[Message]) -> bool:
    """Whether some ordering key has several messages here (a claim chained them)."""
    keys = [m.ordering_key for m in messages if m.ordering_key is not None]
    return len(keys) != len(set(keys))


def chains_together(messages: Sequence[Message]) -> list[Message]:
    """The messages with each key's ones together, in id order, where its first one was."""
    return [m for chain in key_chains(messages) for m in sorted(chain, key=lambda m: m.id)]


def first_of_each_key(
    messages: Sequence[Message],
) -> tuple[list[Message], dict[str | None, list[Message]]]:
    """The messages published at once (every unkeyed one and the first of each key), and
    each key's later ones, in order."""
    chains = key_chains(messages)
    later = {chain[0].ordering_key: chain[1:] for chain in chains if len(chain) > 1}
    return [chain[0] for chain in chains], later


__all__ = [
    "ClaimedRow",
    "FailedAttempt",
    "Message",
    "Settlement",
    "chains_together",
    "first_of_each_key",
    "key_chains",
    "repeats_a_key",
]
