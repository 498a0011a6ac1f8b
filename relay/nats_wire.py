"""A message's NATS header block, encoded once, in the bytes nats-py itself would send.

nats-py encodes headers on every publish with a per-character translation of
each value that costs about 2 us per header here: with the nine headers a relay
sends, a third of its CPU per published message. The relay encodes the block
itself (`header_block`), checks the message's whole size against the server's
limit with it, and its client (`relay_client`) sends the block as it is. The
bytes are the ones nats-py's own encoding gives (tests/relay/test_nats_wire.py
holds the two side by side), so a consumer sees no difference.

The client overrides one internal method of nats-py's Client. At first use
the override is checked against nats-py's own method: same parameters, and
the same bytes for sample headers that exercise each of its encoding rules.
When either differs (another nats-py release), the relay publishes through
nats-py's own encoding, with a warning: slower, not different.
"""

from __future__ import annotations

import functools
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
    """Headers with their encoded block: the relay's client sends `block` unchanged.

    Built once per message and never changed after: `block` would not follow a change.
    """

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


_SAMPLE_HEADERS = {
    "Nats-Msg-Id": "r-1",
    " padded ": "  both ends ",
    "crlf": "one\r\ntwo",
    "": "an empty name is left out",
    "unicode": "caf\u00e9",
}
"""Headers the start check sends through both encodings: each rule nats-py applies."""


def _overridable(base: type) -> bool:
    """Whether nats-py's Client still has the internals relay_client relies on."""
    method = getattr(base, "_send_publish", None)
    if method is None or not hasattr(base, "_send_command") or not hasattr(base, "_flush_pending"):
        return False
    return list(inspect.signature(method).parameters) == _SEND_PUBLISH


def queued_command(client: Any, subject: str, headers: Mapping[str, str]) -> bytes | None:
    """What `client` (never connected) queues for the socket to publish `headers` on
    `subject`; None when it did not finish without waiting."""
    queued: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        queued.append(cmd)

    client._send_command = capture
    payload = b'{"sample":1}'
    # Not connected, nats-py's method queues and returns without ever waiting: one step of
    # the coroutine runs it to its end, on any thread, with or without a running loop.
    step = client._send_publish(subject, "_INBOX.sample.1", payload, len(payload), headers)
    try:
        step.send(None)
    except StopIteration:
        return queued[0] if len(queued) == 1 else None
    step.close()
    return None


def _same_bytes(base: type, ours: type) -> bool:
    """Whether `ours` sends what `base` (nats-py's own encoding) sends, for the sample."""
    try:
        theirs = queued_command(base(), "sample.subject", dict(_SAMPLE_HEADERS))
        mine = queued_command(ours(), "sample.subject", HeaderBlock(_SAMPLE_HEADERS))
    except Exception:  # noqa: BLE001 - any surprise means: not the shape this module knows
        return False
    return theirs is not None and theirs == mine


@functools.cache
def relay_client(nats: Any) -> type:
    """nats-py's Client, sending a HeaderBlock's bytes as they are (see the module)."""
    base: type = nats.aio.client.Client
    bad_subject: type[Exception] = nats.errors.BadSubjectError

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
            if not subject:
                # As nats-py's own method: "HPUB  <reply> ..." would publish to the reply.
                raise bad_subject
            # The rest as nats-py's own method does it after encoding: count, queue, and
            # wake its flusher once per burst.
            self.stats["out_msgs"] += 1
            self.stats["out_bytes"] += payload_size
            await self._send_command(hpub_command(subject, reply, headers.block, payload))
            if self._flush_queue is not None and self._flush_queue.empty():
                await self._flush_pending()

    if _overridable(base) and _same_bytes(base, RelayClient):
        return RelayClient
    log.warning(
        "nats-py %s: its publish internals are not the ones the relay checked; publishing "
        "through its own header encoding (slower, the same bytes)",
        getattr(nats.aio.client, "__version__", "?"),
    )
    return base
