"""The NATS wire as the relay writes it: subjects, header blocks encoded once, publishes.

nats-py encodes headers on every publish with a per-character translation of
each value that costs about 2 us per header here: with the nine headers a relay
sends, a third of its CPU per published message. The relay encodes the block
itself (`header_block`, relay.transports.nats_headers) and checks the message's whole
size against the server's limit with it. The bytes are the ones nats-py's own encoding
gives (tests/relay/test_nats_wire.py holds the two side by side), so a consumer sees
no difference. The relay's fast client (relay.transports.nats_client) sends the block
as it is; nats-py's own client, when the destination does not use the fast one, encodes
the same headers itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from outbox.errors import ConfigError

NO_KEY_TOKEN = "_"  # noqa: S105 - a subject token, not a password
"""The subject token of a message without an ordering key."""
_KEEP = frozenset(chr(c) for c in range(0x21, 0x7F)) - set(".*>%")
"""Characters an ordering key keeps in a subject token; all others are percent-encoded."""
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name NATS accepts: HTTP token characters (nats-py's rule)."""


class Publish(NamedTuple):
    """One message to publish with its header block, and the id of the message it carries."""

    subject: str
    reply: str
    payload: bytes
    headers: HeaderBlock
    message_id: int


async def publish_all(client: Any, publishes: Sequence[Publish]) -> None:
    """Publish each in order: queued together on the relay's fast client
    (relay.transports.nats_client), one by one through nats-py's own publish otherwise."""
    many = getattr(client, "publish_many", None)
    if many is not None:
        await many(publishes)
        return
    for subject, reply, payload, headers, _ in publishes:
        await client.publish(subject, payload, reply=reply, headers=headers)


AnswerHandler = Callable[[str, bytes, Mapping[str, str] | None], None]
"""Called with each answer to the relay's inbox: the subject's last token (the reply
token of the publish it answers), the data, and the headers (a status among them)."""


class BadHeaderName(ValueError):
    """A header name with other than HTTP token characters: NATS would refuse it."""


class HeaderBlock(dict[str, str]):
    """Headers with their encoded block: the relay's client sends `block` unchanged.

    Built once per message and never changed after: `block` would not follow a change.
    """

    __slots__ = ("block",)

    def __init__(self, headers: Mapping[str, str], block: bytes | None = None) -> None:
        """The headers, and `block` = header_block(headers) unless the caller built it."""
        super().__init__(headers)
        self.block = header_block(headers) if block is None else block


_known_names: set[str] = set()
"""Names already checked: a relay sends the same few names on every message."""


STATUS_LINE = "NATS/1.0\r\n"


def header_block(headers: Mapping[str, str]) -> bytes:
    """The NATS/1.0 header block nats-py sends for `headers` (see header_lines)."""
    return f"{STATUS_LINE}{header_lines(headers)}\r\n".encode()


def header_lines(headers: Mapping[str, str]) -> str:
    """The block's line for each header as nats-py writes it: names and values stripped,
    empty names left out, CR and LF in a value sent as spaces; BadHeaderName otherwise."""
    lines = []
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
    return "".join(lines)


def sent_as_is(value: str) -> bool:
    """Whether header_lines writes `value` unchanged: nothing to strip, no CR or LF."""
    return value.isprintable() and value[:1] != " " and value[-1:] != " "


def hpub_command(subject: str, reply: str, block: bytes, payload: bytes) -> bytes:
    """The HPUB protocol command publishing `payload` with the header `block`."""
    head = f"HPUB {subject} {reply} {len(block)} {len(block) + len(payload)}\r\n".encode()
    return b"".join((head, block, payload, b"\r\n"))


async def subscribe_answers(client: Any, inbox: str, handler: AnswerHandler) -> None:
    """Subscribe `handler` to `<inbox>.*`: called from the protocol parser on the relay's
    client (relay_client), through nats-py's subscription queue on its own."""
    prefix = len(inbox) + 1

    async def queued(msg: Any) -> None:
        handler(msg.subject[prefix:], msg.data, msg.headers)

    await client.subscribe(f"{inbox}.*", cb=queued)
    take = getattr(client, "take_answers", None)
    if take is not None:
        take(inbox, handler)


def subject_token(ordering_key: str | None) -> str:
    """The ordering key as one NATS subject token (docs/explanation/contract.md#nats-jetstream).

    Space, '.', '*', '>', '%', control and non-ASCII characters become %XX (each
    UTF-8 byte, upper-case hex); no key is `_`, and the key `_` itself is %5F,
    so different keys never share a token.
    """
    if ordering_key is None:
        return NO_KEY_TOKEN
    if ordering_key == NO_KEY_TOKEN:
        return "%5F"
    return "".join(
        c if c in _KEEP else "".join(f"%{b:02X}" for b in c.encode()) for c in ordering_key
    )


def render_subject(template: str, ordering_key: str | None) -> str:
    """The subject a message is published on: the template with its ordering key token."""
    return template.format(ordering_key=subject_token(ordering_key))


def subject_matches(filter_subject: str, subject: str) -> bool:
    """Whether a stream's subject filter (with * and > wildcards) captures `subject`."""
    wanted, tokens = filter_subject.split("."), subject.split(".")
    for index, part in enumerate(wanted):
        if part == ">":
            return len(tokens) > index
        if index >= len(tokens) or (part != "*" and part != tokens[index]):
            return False
    return len(tokens) == len(wanted)


_STREAM_NAME_REFUSED = frozenset(" \t.*>/\\")


def check_stream_name(name: str) -> None:
    """ConfigError unless `name` is a JetStream stream name: printable, without whitespace,
    '.', '*', '>', '/' or '\\' (names NATS refuses, or whose PubAcks could not be read)."""
    if not name or any(c in _STREAM_NAME_REFUSED or not c.isprintable() for c in name):
        raise ConfigError(
            f"stream {name!r} is not a JetStream stream name: printable characters "
            "without whitespace, '.', '*', '>', '/' or '\\'"
        )
