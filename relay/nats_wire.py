"""A message's NATS header block, encoded once, in the bytes nats-py itself would send.

nats-py encodes headers on every publish with a per-character translation of
each value that costs about 2 us per header here: with the nine headers a relay
sends, a third of its CPU per published message. The relay encodes the block
itself (`header_block`), checks the message's whole size against the server's
limit with it, and its client (`relay_client`) sends the block as it is. The
bytes are the ones nats-py's own encoding gives (tests/relay/test_nats_wire.py
holds the two side by side), so a consumer sees no difference.

The client overrides one internal method of nats-py's Client. When the
installed nats-py no longer has it in the shape read here, the relay publishes
through nats-py's own encoding, with a warning: slower, never different.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("outbox.relay")

_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name NATS accepts: HTTP token characters (nats-py's rule)."""
_SEND_PUBLISH = ["self", "subject", "reply", "payload", "payload_size", "headers"]
"""The internal method's parameters as this module overrides it (nats-py 2.16)."""


class BadHeaderName(ValueError):
    """A header name with other than HTTP token characters: NATS would refuse it."""


class HeaderBlock(dict[str, str]):
    """Headers with their encoded block: the relay's client sends `block` unchanged."""

    __slots__ = ("block",)

    def __init__(self, headers: Mapping[str, str]) -> None:
        """The headers, and `block` = header_block(headers)."""
        super().__init__(headers)
        self.block = header_block(headers)


_known_names: set[str] = set()
"""Names already checked: a relay sends the same few names on every message."""


def header_block(headers: Mapping[str, str]) -> bytes:
    """The NATS/1.0 header block nats-py sends for `headers`: names and values stripped,
    empty names left out, CR and LF in a value sent as spaces; BadHeaderName otherwise."""
    lines = ["NATS/1.0\r\n"]
    for raw_name, raw_value in headers.items():
        name = raw_name.strip()
        if not name:
            continue
        if name not in _known_names:
            if not _NAME.fullmatch(name):
                raise BadHeaderName(f"header name {name!r} is not a NATS header name")
            if len(_known_names) < 1024:
                _known_names.add(name)
        value = raw_value.strip()
        if "\r" in value or "\n" in value:
            value = value.replace("\r", " ").replace("\n", " ")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode()


def hpub_command(subject: str, reply: str, block: bytes, payload: bytes) -> bytes:
    """The HPUB protocol command publishing `payload` with the header `block`."""
    head = f"HPUB {subject} {reply} {len(block)} {len(block) + len(payload)}\r\n".encode()
    return b"".join((head, block, payload, b"\r\n"))


def _overridable(base: type) -> bool:
    """Whether nats-py's Client still has the internals relay_client relies on."""
    method = getattr(base, "_send_publish", None)
    if method is None or not hasattr(base, "_send_command") or not hasattr(base, "_flush_pending"):
        return False
    return list(inspect.signature(method).parameters) == _SEND_PUBLISH


@functools.cache
def relay_client(nats: Any) -> type:
    """nats-py's Client, sending a HeaderBlock's bytes as they are (see the module)."""
    base: type = nats.aio.client.Client
    if not _overridable(base):
        log.warning(
            "nats-py %s: its publish internals changed; publishing through its own header "
            "encoding (slower, the same bytes)",
            importlib.metadata.version("nats-py"),
        )
        return base

    class RelayClient(base):  # type: ignore[misc]
        async def _send_publish(
            self,
            subject: str,
            reply: str,
            payload: bytes,
            payload_size: int,
            headers: Mapping[str, str] | None,
        ) -> None:
            if not isinstance(headers, HeaderBlock):
                await super()._send_publish(subject, reply, payload, payload_size, headers)
                return
            # The rest as nats-py's own method does it after encoding: count, queue, and
            # wake its flusher once per burst.
            self.stats["out_msgs"] += 1
            self.stats["out_bytes"] += payload_size
            await self._send_command(hpub_command(subject, reply, headers.block, payload))
            if self._flush_queue is not None and self._flush_queue.empty():
                await self._flush_pending()

    return RelayClient
