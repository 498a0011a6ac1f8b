"""Verify a delivery's signature in your own receiver, by the rules the relay signs with.

    reply_id = receiver.verify(request.headers, body, secrets=["whsec_..."])

Returns the signed `webhook-id` (the message's reply_id, or a batch's id) and
raises `outbox.errors.SignatureError` for anything else: a missing or malformed header, a
timestamp outside the tolerance, no signature made with a current secret.
Several secrets are accepted at once, for rotation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from outbox.signing import DEFAULT_TOLERANCE, parse_secret
from outbox.signing import verify as verify_with_keys


def verify(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Iterable[str | bytes],
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    now: float | None = None,
) -> str:
    """The signed webhook-id of this request, or SignatureError; `now` is for tests."""
    if isinstance(secrets, str | bytes):
        raise TypeError("secrets must be a list of secrets, not one secret")
    keys = [parse_secret(secret) for secret in secrets]
    if not keys:
        raise ValueError("at least one secret is needed to verify a signature")
    return verify_with_keys(keys, headers, body, tolerance=tolerance, now=now)
