"""A broker message as a consumer receives it, and the checks it must pass to be stored.

Broker-free: receiver.nats_consumer and receiver.rabbitmq_consumer turn their client's
messages into Deliveries (headers through ``lowercased``), and receiver.consume checks
each with ``check`` before it stores any.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from outbox.canonical import sha256_hex
from outbox.errors import ConfigError, SignatureError
from outbox.messages import ORDERING_KEY, is_reply_id
from outbox.signing import (
    CONTENT_HASH_HEADER,
    ID_HEADER,
    ORDERING_KEY_HEADER,
    SigningKey,
    is_broker_message_id,
    parse_secret,
    verify,
)
from receiver.strict_json import InvalidJSON, check_strict_json


@dataclass(frozen=True)
class Delivery:
    """One broker message: its headers (names lowercased), exact body, broker message id;
    what the broker says of its deliveries, and where it keeps it (for a dead letter)."""

    headers: Mapping[str, str]
    body: bytes
    broker_id: str | None = None
    redelivered: bool = False
    """The broker delivered it before (a lost ack, a requeue, a nak)."""
    deliveries: int | None = None
    """The broker's count of its deliveries, this one included, when it keeps one."""
    broker_ref: str | None = None
    """Where the broker keeps it: a stream and sequence, a queue."""


class Invalid(ValueError):
    """A message that can never be accepted; its text says why."""


def signing_keys(secrets: Iterable[str | bytes] | None, unsigned: bool) -> tuple[SigningKey, ...]:
    """The keys to verify with; unsigned=True (and no secrets) checks no signature."""
    if isinstance(secrets, str | bytes):
        raise TypeError("secrets must be a list of secrets, not one secret")
    keys = tuple(parse_secret(secret) for secret in secrets or ())
    if unsigned and keys:
        raise ConfigError("secrets and unsigned=True: choose one")
    if not unsigned and not keys:
        raise ConfigError("no secret to verify signatures: give secrets, or unsigned=True")
    return keys


def check(delivery: Delivery, keys: Sequence[SigningKey]) -> str:
    """The message's reply_id, or Invalid; no keys: the signature is not checked."""
    headers = delivery.headers
    reply_id = headers.get(ID_HEADER)
    if not is_reply_id(reply_id):
        raise Invalid(f"missing or malformed {ID_HEADER} header")
    assert reply_id is not None
    broker_id = delivery.broker_id
    if broker_id is not None and not is_broker_message_id(
        broker_id, reply_id, keys, unsigned=not keys
    ):
        raise Invalid(f"the broker's message id is neither {ID_HEADER} nor derived from it")
    if keys:
        try:
            # No freshness limit: the broker may have held the message for hours.
            verify(keys, headers, delivery.body, tolerance=math.inf)
        except SignatureError as exc:
            raise Invalid(f"signature: {exc}") from exc
    declared = headers.get(CONTENT_HASH_HEADER)
    if declared is None:
        raise Invalid(f"missing {CONTENT_HASH_HEADER} header")
    if declared != sha256_hex(delivery.body):
        raise Invalid(f"the body's SHA-256 differs from its {CONTENT_HASH_HEADER} header")
    try:
        check_strict_json(delivery.body)
    except InvalidJSON as exc:
        raise Invalid(f"body is not strict JSON: {exc}") from exc
    ordering_key(delivery)
    return reply_id


def ordering_key(delivery: Delivery) -> str | None:
    """The message's ordering key (None: it has none), or Invalid when malformed."""
    key = delivery.headers.get(ORDERING_KEY_HEADER)
    if key is not None and not ORDERING_KEY.fullmatch(key):
        raise Invalid(f"malformed {ORDERING_KEY_HEADER} header")
    return key


def shown_id(delivery: Delivery) -> str:
    """The message's id for a log line, cut short: it may be anything."""
    text = delivery.headers.get(ID_HEADER) or delivery.broker_id or "(none)"
    return text[:200]


def header_text(value: object) -> str | None:
    """A header value as text (AMQP tables may carry bytes); None for other types."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def lowercased(headers: Mapping[str, object] | None) -> dict[str, str]:
    """Header names lowercased, values as text; a value that is not text is left out."""
    result: dict[str, str] = {}
    for name, value in (headers or {}).items():
        text = header_text(value)
        if text is not None:
            result[name.lower()] = text
    return result
