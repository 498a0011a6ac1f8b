"""Standard Webhooks signatures, shared by the relay (signing) and the receiver (verifying).

The signed content is ``{webhook-id}.{webhook-timestamp}.{body}`` over the exact
body bytes, HMAC-SHA256 keyed by the secret (``whsec_`` + base64, the form the
``standardwebhooks`` package takes); ``webhook-signature`` holds one or more
space-separated ``v1,<base64>`` entries so a sender can sign with the old and
the new secret during a rotation, and a receiver can accept several secrets.

We build on the ``standardwebhooks`` package's secret format (the tests pin
byte-for-byte agreement with ``Webhook.sign`` and ``Webhook.verify``) but do
not call ``Webhook.verify`` itself: its timestamp
tolerance is fixed at five minutes against its own wall clock, it decodes the
body as text (so a signed non-UTF-8 body could never verify and would not get
its proper 400), and a garbled header raises assorted exceptions. Here every
failure is one ``SignatureError``.

A GET that asks for a stored receipt is signed the same way with the reply_id
as ``webhook-id`` and an empty body.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from outbox.errors import SignatureError

SECRET_PREFIX = "whsec_"  # noqa: S105 - a format prefix, not a secret
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
CONTENT_HASH_HEADER = "outbox-content-hash"
"""Broker messages carry the body's SHA-256 (hex), so a consumer can check the bytes it
got are the bytes the outbox stored before it dedupes by (reply_id, hash)."""
ORDERING_KEY_HEADER = "outbox-ordering-key"
"""Broker messages of an ordering key carry it, so a consumer applies a key's messages in
order and holds back the later ones while an earlier one is still to be applied."""
DEFAULT_TOLERANCE = 300

# The id is signed as "id.timestamp.body", so a '.' in it would make the string ambiguous.
_MSG_ID = re.compile(r"[\x21-\x2d\x2f-\x7e]{1,200}")
# Whole seconds only: a fraction or exponent would be re-rendered differently by each side.
_TIMESTAMP = re.compile(r"[1-9][0-9]{0,11}")
_MAX_SIGNATURES = 16


@dataclass(frozen=True, repr=False)
class SigningKey:
    """A decoded webhook secret; its repr never shows the key."""

    key: bytes

    def __repr__(self) -> str:
        return "SigningKey(<redacted>)"

    def mac(self, prefix: bytes, body: bytes) -> bytes:
        """HMAC-SHA256 of `prefix` followed by `body` under this key."""
        # RFC 2104 from copies of the hash states after the key's pads: only C calls per
        # message (hmac.HMAC's copy, update and digest are Python methods around them),
        # and updating twice skips copying the body into one string.
        inner, outer = _padded(self.key)
        state = inner.copy()
        state.update(prefix)
        state.update(body)
        result = outer.copy()
        result.update(state.digest())
        return result.digest()


_BLOCK = hashlib.sha256().block_size
_INNER_PAD = bytes(byte ^ 0x36 for byte in range(256))
_OUTER_PAD = bytes(byte ^ 0x5C for byte in range(256))


@functools.lru_cache(maxsize=64)
def _padded(key: bytes) -> tuple[hashlib._Hash, hashlib._Hash]:
    """SHA-256 states after the key's inner and outer pads: each MAC continues copies (kept
    here, not on the SigningKey, which stays a plain value to copy or pickle)."""
    if len(key) > _BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_BLOCK, b"\0")
    return hashlib.sha256(key.translate(_INNER_PAD)), hashlib.sha256(key.translate(_OUTER_PAD))


BROKER_ID_PREFIX = "hmac1-"
"""How a broker message id derived from the destination's secret begins (broker_message_id)."""
_BROKER_ID_CONTEXT = b"nats-msg-id:"
# 128 bits of the MAC: far beyond guessing, and a short id in the stream's dedupe table.
_BROKER_ID_BYTES = 16


def broker_message_id(secret: str | bytes | SigningKey, reply_id: str) -> str:
    """The `Nats-Msg-Id` a signed relay publishes `reply_id` under: only the secret's holders
    can compute it, so nobody else can take it first and have the stream drop the reply.

    The same for every relay and every attempt with this secret (the stream's duplicate
    window still drops resends). Domain-separated from signatures: a reply_id holds no
    '.', while every signed string ``id.timestamp.body`` does.
    """
    digest = parse_secret(secret).mac(_BROKER_ID_CONTEXT, reply_id.encode())
    token = base64.urlsafe_b64encode(digest[:_BROKER_ID_BYTES]).rstrip(b"=").decode("ascii")
    return BROKER_ID_PREFIX + token


def is_broker_message_id(
    broker_id: str, reply_id: str, keys: Iterable[SigningKey], *, unsigned: bool = False
) -> bool:
    """Whether a broker message id fits `reply_id`: the reply_id itself (an unsigned relay,
    or a relay older than the derived id), or broker_message_id under one of `keys`; with
    `unsigned` (no key to check with) any id of the derived form."""
    if broker_id == reply_id:
        return True
    if not broker_id.startswith(BROKER_ID_PREFIX):
        return False
    if unsigned:
        return True
    return any(
        hmac.compare_digest(broker_id.encode(), broker_message_id(key, reply_id).encode())
        for key in keys
    )


def parse_secret(secret: str | bytes | SigningKey) -> SigningKey:
    """Decode a ``whsec_<base64>`` secret (raw bytes are taken as the key); ValueError if bad."""
    if isinstance(secret, SigningKey):
        return secret
    if isinstance(secret, bytes):
        key = secret
    elif isinstance(secret, str):
        text = secret.strip()
        text = text.removeprefix(SECRET_PREFIX)
        try:
            # Unlike the library's b64decode, refuse stray characters: a typo is not a key.
            key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(
                "webhook secret is not valid base64 (expected whsec_<base64>; make one with "
                "`outbox secret new`)"
            ) from exc
    else:
        raise TypeError(f"a webhook secret is str or bytes, not {type(secret).__name__}")
    if len(key) < 16:
        raise ValueError(
            f"webhook secret is shorter than 16 bytes (it decodes to {len(key)}): make one "
            "with `outbox secret new`"
        )
    return SigningKey(key)


def is_webhook_id(msg_id: str) -> bool:
    """Whether `msg_id` may be signed: 1..200 printable ASCII characters without '.'."""
    return _MSG_ID.fullmatch(msg_id) is not None


def signature(secret: str | bytes | SigningKey, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature of ``msg_id.timestamp.body``."""
    digest = parse_secret(secret).mac(f"{msg_id}.{timestamp}.".encode(), body)
    return "v1," + binascii.b2a_base64(digest, newline=False).decode("ascii")


def sign(
    secret: str | bytes | SigningKey | Iterable[str | bytes | SigningKey],
    msg_id: str,
    timestamp: float | None,
    body: bytes,
) -> dict[str, str]:
    """The three Standard Webhooks headers; several secrets give several signatures."""
    if not is_webhook_id(msg_id):
        raise ValueError(f"webhook id must be 1..200 printable ASCII without '.', got {msg_id!r}")
    seconds = int(time.time() if timestamp is None else timestamp)
    if isinstance(secret, str | bytes | SigningKey):
        # One secret, the usual case: a relay signs each message published to a broker.
        signatures = signature(secret, msg_id, seconds, body)
    else:
        secrets = list(secret)
        if not secrets:
            raise ValueError("at least one secret is needed to sign")
        signatures = " ".join(signature(s, msg_id, seconds, body) for s in secrets)
    return {ID_HEADER: msg_id, TIMESTAMP_HEADER: str(seconds), SIGNATURE_HEADER: signatures}


def verify(
    keys: Iterable[SigningKey],
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> str:
    """Check the headers sign `body` with one of `keys`; return the webhook-id or SignatureError."""
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id = lowered.get(ID_HEADER)
    stamp = lowered.get(TIMESTAMP_HEADER)
    signatures = lowered.get(SIGNATURE_HEADER)
    if not msg_id or not stamp or not signatures:
        raise SignatureError("missing webhook-id, webhook-timestamp or webhook-signature")
    if not is_webhook_id(msg_id):
        raise SignatureError("malformed webhook-id")
    if not _TIMESTAMP.fullmatch(stamp):
        raise SignatureError("webhook-timestamp is not whole epoch seconds")
    timestamp = int(stamp)
    current = time.time() if now is None else now
    if timestamp < current - tolerance:
        raise SignatureError("webhook-timestamp is too old")
    if timestamp > current + tolerance:
        raise SignatureError("webhook-timestamp is too new")
    offered = []
    for entry in signatures.split(" ")[:_MAX_SIGNATURES]:
        version, sep, encoded = entry.partition(",")
        if not sep or version != "v1":
            continue  # other schemes (v1a asymmetric) are not ours to judge
        try:
            offered.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    if not offered:
        raise SignatureError("no v1 signature in webhook-signature")
    prefix = f"{msg_id}.{timestamp}.".encode()
    matched = False
    for key in keys:
        expected = key.mac(prefix, body)
        for candidate in offered:
            # Keep comparing after a match so the time taken does not say which secret matched.
            matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise SignatureError("no signature matches a current secret")
    return msg_id
