"""Standard Webhooks signing and verification (outbox.signing), pinned to the library."""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook
from support.receiver_helpers import OTHER_SECRET, SECRET

import receiver
from outbox.errors import SignatureError
from outbox.signing import SigningKey, parse_secret, sign, signature, verify
from relay.config import make_destination
from relay.webhooks import request_headers

# The published Standard Webhooks / Svix example: computed by someone else's code.
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_known_answer_vector() -> None:
    assert signature(VECTOR_SECRET, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIG
    headers = sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TS, VECTOR_BODY)
    assert headers == {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": str(VECTOR_TS),
        "webhook-signature": VECTOR_SIG,
    }
    keys = [parse_secret(VECTOR_SECRET)]
    assert verify(keys, headers, VECTOR_BODY, now=VECTOR_TS + 10) == VECTOR_ID


@pytest.mark.parametrize("length", [16, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("body", [b"", b"{}", bytes(range(256)) * 5])
def test_each_mac_is_the_standard_library_hmac(length: int, body: bytes) -> None:
    key = bytes((7 * n + length) % 256 for n in range(length))
    prefix = b"r-1.1700000000."
    expected = hmac.digest(key, prefix + body, hashlib.sha256)
    assert SigningKey(key).mac(prefix, body) == expected
    assert SigningKey(key).mac(prefix, body) == expected  # the cached states are not used up


def test_agrees_with_the_standardwebhooks_library() -> None:
    body = '{"kind":"result","text":"héllo ✓"}'.encode()
    now = int(time.time())
    ours = sign(SECRET, "reply:abc", now, body)
    library = Webhook(SECRET)
    assert (
        library.sign("reply:abc", datetime.fromtimestamp(now, tz=UTC), body.decode())
        == (ours["webhook-signature"])
    )
    library.verify(body, ours, json_parse=False)  # raises if the library disagrees


def test_several_secrets_sign_and_verify_for_rotation() -> None:
    both = sign([SECRET, OTHER_SECRET], "r-1", 1000, b"{}")
    assert len(both["webhook-signature"].split(" ")) == 2
    assert verify([parse_secret(OTHER_SECRET)], both, b"{}", now=1000) == "r-1"
    old_only = sign(SECRET, "r-1", 1000, b"{}")
    keys = [parse_secret(SECRET), parse_secret(OTHER_SECRET)]
    assert verify(keys, old_only, b"{}", now=1000) == "r-1"
    with pytest.raises(SignatureError):
        verify([parse_secret(OTHER_SECRET)], old_only, b"{}", now=1000)


def test_a_body_that_is_not_utf8_still_signs_over_its_exact_bytes() -> None:
    body = b"\xff\xfe{}"
    headers = sign(SECRET, "r-1", 1000, body)
    assert verify([parse_secret(SECRET)], headers, body, now=1000) == "r-1"
    with pytest.raises(SignatureError):
        verify([parse_secret(SECRET)], headers, b"\xff\xfe{ }", now=1000)


@pytest.mark.parametrize(
    ("offset", "ok"),
    [(-301, False), (-300, True), (0, True), (300, True), (301, False)],
)
def test_timestamp_tolerance_is_ours_not_the_library_fixed_one(offset: int, ok: bool) -> None:
    headers = sign(SECRET, "r-1", 10_000 + offset, b"{}")
    keys = [parse_secret(SECRET)]
    if ok:
        assert verify(keys, headers, b"{}", tolerance=300, now=10_000) == "r-1"
    else:
        with pytest.raises(SignatureError, match=r"too (old|new)"):
            verify(keys, headers, b"{}", tolerance=300, now=10_000)
    # A wider tolerance than the library's five minutes is honoured.
    far = sign(SECRET, "r-1", 10_000 - 3600, b"{}")
    assert verify(keys, far, b"{}", tolerance=7200, now=10_000) == "r-1"


GOOD = sign(SECRET, "r-1", 1000, b"{}")
GARBLED = [
    {},
    {**GOOD, "webhook-id": ""},
    {k: v for k, v in GOOD.items() if k != "webhook-timestamp"},
    {k: v for k, v in GOOD.items() if k != "webhook-signature"},
    {**GOOD, "webhook-id": "has.dot"},
    {**GOOD, "webhook-id": "has space"},
    {**GOOD, "webhook-timestamp": "abc"},
    {**GOOD, "webhook-timestamp": "1000.5"},
    {**GOOD, "webhook-timestamp": "1e3"},
    {**GOOD, "webhook-timestamp": "-1000"},
    {**GOOD, "webhook-timestamp": "9" * 40},
    {**GOOD, "webhook-signature": "garbage"},
    {**GOOD, "webhook-signature": "v1,"},
    {**GOOD, "webhook-signature": "v1,!!!not-base64!!!"},
    {**GOOD, "webhook-signature": "v1,abc"},
    {**GOOD, "webhook-signature": "v2," + GOOD["webhook-signature"][3:]},
    {**GOOD, "webhook-signature": "v1a," + GOOD["webhook-signature"][3:]},
    {**GOOD, "webhook-signature": ","},
    {**GOOD, "webhook-signature": " " * 10},
]


@pytest.mark.parametrize("headers", GARBLED)
def test_every_malformed_header_is_one_signature_error(headers: dict[str, str]) -> None:
    with pytest.raises(SignatureError):
        verify([parse_secret(SECRET)], headers, b"{}", now=1000)


def test_header_names_are_case_insensitive() -> None:
    upper = {name.upper(): value for name, value in GOOD.items()}
    assert verify([parse_secret(SECRET)], upper, b"{}", now=1000) == "r-1"


@pytest.mark.parametrize("secret", ["", "whsec_", "whsec_!!!!", "whsec_c2hvcnQ=", b"short"])
def test_bad_secrets_are_refused_up_front(secret: str | bytes) -> None:
    with pytest.raises(ValueError, match="secret"):
        parse_secret(secret)


def test_a_signing_key_never_shows_its_bytes() -> None:
    assert "receiver-test" not in repr(parse_secret(SECRET))


def test_integrators_verify_what_the_relay_signs() -> None:
    destination = make_destination("http://billing.invalid/replies", secret=SECRET)
    body = b'{"order":17}'
    headers = request_headers(destination, "order-17:paid", body)
    now = float(headers["webhook-timestamp"])
    assert receiver.verify(headers, body, [OTHER_SECRET, SECRET], now=now) == "order-17:paid"
    with pytest.raises(SignatureError, match="no signature matches"):
        receiver.verify(headers, body + b" ", [SECRET], now=now)
    with pytest.raises(SignatureError, match="no signature matches"):
        receiver.verify(headers, body, [OTHER_SECRET], now=now)
    with pytest.raises(SignatureError, match="too old"):
        receiver.verify(headers, body, [SECRET], now=now + 301)
    with pytest.raises(TypeError, match="a list of secrets"):
        receiver.verify(headers, body, SECRET, now=now)


def test_the_derived_broker_id_is_stable_per_secret_and_unguessable_without_it() -> None:
    from outbox.signing import BROKER_ID_PREFIX, broker_message_id, parse_secret

    derived = broker_message_id(SECRET, "r-1")
    # The same for every relay and attempt with the secret: the stream's dedupe holds.
    assert derived == broker_message_id(parse_secret(SECRET), "r-1")
    assert derived.startswith(BROKER_ID_PREFIX)
    assert len(derived) == len(BROKER_ID_PREFIX) + 22
    assert derived != broker_message_id(OTHER_SECRET, "r-1")
    assert derived != broker_message_id(SECRET, "r-2")


@pytest.mark.parametrize(
    ("broker_id", "secrets", "accepted"),
    [
        (None, [SECRET], True),
        ("r-1", [SECRET], True),  # an unsigned relay's, or one from before the derived id
        ("derived", [SECRET], True),
        ("derived", [OTHER_SECRET, SECRET], True),  # during a rotation
        ("derived", [OTHER_SECRET], False),
        ("hmac1-AAAAAAAAAAAAAAAAAAAAAA", [SECRET], False),
        ("r-2", [SECRET], False),
        ("derived", None, True),  # unsigned: nothing to check the id with
        ("r-2", None, False),
    ],
)
def test_the_consumer_takes_the_reply_id_or_the_id_derived_from_it(
    broker_id: str | None, secrets: list[str] | None, accepted: bool
) -> None:
    from outbox.canonical import sha256_hex
    from outbox.signing import CONTENT_HASH_HEADER, broker_message_id, sign
    from receiver.deliveries import Delivery, Invalid, check, signing_keys

    body = b"{}"
    headers = {**sign(SECRET, "r-1", None, body), CONTENT_HASH_HEADER: sha256_hex(body)}
    if broker_id == "derived":
        broker_id = broker_message_id(SECRET, "r-1")
    keys = signing_keys(secrets, unsigned=secrets is None)
    delivery = Delivery(headers, body, broker_id)
    if accepted:
        assert check(delivery, keys) == "r-1"
    else:
        with pytest.raises(Invalid, match="message id"):
            check(delivery, keys)
