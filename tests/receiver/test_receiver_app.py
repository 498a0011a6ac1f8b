"""The HTTP receiver on both backends: happy path, rotation, lookup and the bad-input catalogue."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from support.receiver_helpers import (
    OTHER_SECRET,
    SECRET,
    AppClient,
    count_effects,
    refused_connection,
    signed,
    stored_receipts,
)

import outbox
from outbox.canonical import sha256_hex
from outbox.signing import sign
from receiver import ReceiptStore, create_app
from receiver.effects import record_effect
from receiver.rules import MAX_DEPTH, RETENTION_HEADER

NOW = 1_700_000_000
MAX_BODY = 16_384
RETENTION = str(30 * 86_400)
BODY = b'{"kind":"result","task_id":"t-1","status":"done","result":{"n":1}}'


def client_for(store: ReceiptStore, secrets: list[str], now: float = NOW) -> AppClient:
    """A test client for an app whose signature clock reads `now`."""
    app = create_app(
        store, secrets=secrets, max_body=MAX_BODY, wall_clock=lambda: now, effect=record_effect
    )
    return AppClient(app)


@pytest.fixture
def client(store: ReceiptStore) -> Iterator[AppClient]:
    """A client for the app with the one test secret."""
    with client_for(store, [SECRET]) as c:
        yield c


def post(client: AppClient, reply_id: str, body: bytes, secret: str | list[str] = SECRET) -> Any:
    """POST a correctly signed reply."""
    return client.post("/replies", content=body, headers=signed(reply_id, body, secret, NOW))


def test_stores_then_answers_duplicate(client: AppClient, db_url: str) -> None:
    first = post(client, "reply:t-1", BODY)
    assert first.status_code == 200
    assert first.json() == {"ack": "stored", "reply_id": "reply:t-1", "duplicate": False}
    assert first.headers[RETENTION_HEADER] == RETENTION
    second = post(client, "reply:t-1", BODY)
    assert second.status_code == 200
    assert second.json()["duplicate"] is True
    assert count_effects(db_url) == 1
    assert stored_receipts(db_url) == {"reply:t-1": BODY}


def test_same_id_other_body_is_409(client: AppClient, db_url: str) -> None:
    assert post(client, "r-1", b'{"v":1}').status_code == 200
    conflict = post(client, "r-1", b'{"v":2}')
    assert conflict.status_code == 409
    assert conflict.headers[RETENTION_HEADER] == RETENTION
    assert stored_receipts(db_url) == {"r-1": b'{"v":1}'}
    assert count_effects(db_url) == 1


def test_known_answer_vector_is_accepted(store: ReceiptStore, db_url: str) -> None:
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    headers = {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
        "content-type": "application/json",
    }
    body = b'{"test": 2432232314}'
    with client_for(store, [secret], now=1614265330 + 10) as c:
        answer = c.post("/replies", content=body, headers=headers)
        assert answer.status_code == 200
        assert answer.json()["reply_id"] == "msg_p5jXN8AQM9LWM0D4loKWxJek"
        tampered = c.post("/replies", content=b'{"test": 2432232315}', headers=headers)
        assert tampered.status_code == 401
    with client_for(store, [secret], now=1614265330 + 301) as late:
        assert late.post("/replies", content=body, headers=headers).status_code == 401
    assert count_effects(db_url) == 1


def test_secret_rotation(store: ReceiptStore, db_url: str) -> None:
    with client_for(store, [SECRET, OTHER_SECRET]) as both:
        assert post(both, "r-old", b"{}", SECRET).status_code == 200
        assert post(both, "r-new", b"{}", OTHER_SECRET).status_code == 200
        assert post(both, "r-both", b"{}", [SECRET, OTHER_SECRET]).status_code == 200
    with client_for(store, [OTHER_SECRET]) as revoked:
        assert post(revoked, "r-old-2", b"{}", SECRET).status_code == 401
        assert post(revoked, "r-new-2", b"{}", OTHER_SECRET).status_code == 200
        # A sender still signing with both during its own rollover keeps working.
        assert post(revoked, "r-both-2", b"{}", [SECRET, OTHER_SECRET]).status_code == 200
    assert set(stored_receipts(db_url)) == {"r-old", "r-new", "r-both", "r-new-2", "r-both-2"}


def test_receipt_lookup_is_signed(client: AppClient) -> None:
    assert post(client, "r-1", BODY).status_code == 200
    found = client.get("/replies/r-1", headers=sign(SECRET, "r-1", NOW, b""))
    assert found.status_code == 200
    document = found.json()
    assert document["reply_id"] == "r-1"
    assert document["content_hash"] == sha256_hex(BODY)
    assert isinstance(document["received_at"], float)
    assert found.headers[RETENTION_HEADER] == RETENTION
    missing = client.get("/replies/r-2", headers=sign(SECRET, "r-2", NOW, b""))
    assert missing.status_code == 404
    assert client.get("/replies/r-1").status_code == 401
    other_id = client.get("/replies/r-1", headers=sign(SECRET, "r-2", NOW, b""))
    assert other_id.status_code == 401
    wrong_secret = client.get("/replies/r-1", headers=sign(OTHER_SECRET, "r-1", NOW, b""))
    assert wrong_secret.status_code == 401


def test_healthz_and_unknown_routes_carry_the_retention(client: AppClient) -> None:
    health = client.get("/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert health.headers[RETENTION_HEADER] == RETENTION
    unknown = client.get("/nowhere")
    assert unknown.status_code == 404
    assert unknown.headers[RETENTION_HEADER] == RETENTION


def test_retention_header_follows_the_store(db_url: str) -> None:
    with ReceiptStore(db_url, retention=7 * 86_400) as short, client_for(short, [SECRET]) as c:
        assert c.get("/healthz").headers[RETENTION_HEADER] == str(7 * 86_400)


def test_database_unreachable_is_503(db_url: str, backend: str) -> None:
    engine = outbox.create_engine(db_url)
    store = ReceiptStore(engine)

    @sa.event.listens_for(engine, "do_connect")
    def refuse(*args: object) -> None:
        raise refused_connection(backend)

    engine.dispose()
    try:
        with client_for(store, [SECRET]) as c:
            answer = post(c, "r-1", BODY)
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "1"
            lookup = c.get("/replies/r-1", headers=sign(SECRET, "r-1", NOW, b""))
            assert lookup.status_code == 503
    finally:
        engine.dispose()
    assert count_effects(db_url) == 0


# --- the bad-input catalogue ---------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """One bad request: how to send it and the status it must get."""

    name: str
    status: int
    send: Callable[[AppClient], Any]


def _post(body: bytes, headers: dict[str, str], **kwargs: Any) -> Callable[[AppClient], Any]:
    return lambda c: c.post("/replies", content=body, headers=headers, **kwargs)


def _json_case(name: str, body: bytes) -> Bad:
    return Bad(name, 400, _post(body, signed("r-bad", body, SECRET, NOW)))


def _without(header: str) -> dict[str, str]:
    return {k: v for k, v in signed("r-bad", BODY, SECRET, NOW).items() if k != header}


def _with(**changes: str) -> dict[str, str]:
    headers = signed("r-bad", BODY, SECRET, NOW)
    headers.update({k.replace("_", "-"): v for k, v in changes.items()})
    return headers


def _chunks(total: int) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        piece = min(1000, total - sent)
        sent += piece
        yield b" " * piece


BIG = b'{"pad":"' + b"x" * MAX_BODY + b'"}'
SIG = signed("r-bad", BODY, SECRET, NOW)["webhook-signature"]

CATALOGUE = [
    # signature: every malformed header is 401, never 500
    Bad("no signature headers", 401, _post(BODY, {"content-type": "application/json"})),
    Bad("missing webhook-id", 401, _post(BODY, _without("webhook-id"))),
    Bad("missing webhook-timestamp", 401, _post(BODY, _without("webhook-timestamp"))),
    Bad("missing webhook-signature", 401, _post(BODY, _without("webhook-signature"))),
    Bad("garbled signature", 401, _post(BODY, _with(webhook_signature="garbage"))),
    Bad("non-base64 signature", 401, _post(BODY, _with(webhook_signature="v1,!!not b64!!"))),
    Bad("empty v1 signature", 401, _post(BODY, _with(webhook_signature="v1,"))),
    Bad("unknown scheme only", 401, _post(BODY, _with(webhook_signature="v9," + SIG[3:]))),
    Bad("truncated signature", 401, _post(BODY, _with(webhook_signature=SIG[:-8]))),
    Bad("wrong secret", 401, _post(BODY, signed("r-bad", BODY, OTHER_SECRET, NOW))),
    Bad("timestamp too old", 401, _post(BODY, signed("r-bad", BODY, SECRET, NOW - 301))),
    Bad("timestamp too new", 401, _post(BODY, signed("r-bad", BODY, SECRET, NOW + 301))),
    Bad("timestamp not a number", 401, _post(BODY, _with(webhook_timestamp="soon"))),
    Bad("timestamp fractional", 401, _post(BODY, _with(webhook_timestamp=f"{NOW}.5"))),
    Bad("timestamp huge", 401, _post(BODY, _with(webhook_timestamp="9" * 400))),
    Bad("body tampered after signing", 401, _post(BODY + b" ", signed("r-bad", BODY))),
    Bad("id swapped after signing", 401, _post(BODY, _with(webhook_id="r-other"))),
    Bad("id with a dot", 401, _post(BODY, _with(webhook_id="r.bad"))),
    # content type
    Bad("text/plain", 415, _post(BODY, signed("r-bad", BODY, SECRET, NOW, "text/plain"))),
    Bad("no content type", 415, _post(BODY, signed("r-bad", BODY, SECRET, NOW, None))),
    Bad(
        "json in latin-1",
        415,
        _post(BODY, signed("r-bad", BODY, SECRET, NOW, "application/json; charset=latin-1")),
    ),
    # size, before buffering
    Bad("oversized body", 413, _post(BIG, signed("r-bad", BIG, SECRET, NOW))),
    Bad(
        "oversized Content-Length",
        413,
        _post(BODY, {**signed("r-bad", BODY, SECRET, NOW), "content-length": str(MAX_BODY + 1)}),
    ),
    Bad(
        "oversized chunked body",
        413,
        lambda c: c.post(
            "/replies", content=_chunks(MAX_BODY + 1), headers=signed("r-bad", BODY, SECRET, NOW)
        ),
    ),
    Bad(
        "Content-Length lies low, body over the limit",
        413,
        _post(BIG, {**signed("r-bad", BIG, SECRET, NOW), "content-length": "10"}),
    ),
    Bad(
        "Content-Length lies low",
        400,
        _post(BODY, {**signed("r-bad", BODY, SECRET, NOW), "content-length": "10"}),
    ),
    Bad(
        "Content-Length not a number",
        400,
        _post(BODY, {**signed("r-bad", BODY, SECRET, NOW), "content-length": "ten"}),
    ),
    # strict JSON
    _json_case("empty body", b""),
    _json_case("invalid UTF-8", b'{"a":"\xff"}'),
    _json_case("overlong UTF-8", b'{"a":"\xc0\xaf"}'),
    _json_case("UTF-8 BOM", b'\xef\xbb\xbf{"a":1}'),
    _json_case("UTF-16", '{"a":1}'.encode("utf-16")),
    _json_case("NaN", b'{"a":NaN}'),
    _json_case("Infinity", b'{"a":Infinity}'),
    _json_case("-Infinity", b'{"a":-Infinity}'),
    _json_case("duplicate keys", b'{"a":1,"a":2}'),
    _json_case("duplicate keys nested", b'{"x":{"a":1,"a":1}}'),
    _json_case("nesting over the limit", b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)),
    _json_case("nesting far over the limit", b"[" * 3000 + b"]" * 3000),
    _json_case("lone surrogate", b'{"a":"\\ud800"}'),
    _json_case("lone surrogate in a key", b'{"\\udfff":1}'),
    _json_case("NUL", b'{"a":"\\u0000"}'),
    _json_case("NUL in a key", b'{"\\u0000":1}'),
    _json_case("raw control character", b'{"a":"\x01"}'),
    _json_case("truncated", b'{"a":'),
    _json_case("trailing garbage", b'{"a":1} x'),
    _json_case("single quotes", b"{'a':1}"),
    _json_case("integer too long", b'{"a":' + b"9" * 5000 + b"}"),
]


def _collision(client: AppClient, store: ReceiptStore) -> Any:
    store.accept("r-bad", b'{"first":true}', record_effect)
    return client.post("/replies", content=BODY, headers=signed("r-bad", BODY, SECRET, NOW))


def test_catalogue_cases_are_distinct() -> None:
    # 48 table rows plus the collision case: a row lost in an edit shows up here.
    assert len({case.name for case in CATALOGUE}) == len(CATALOGUE) == 48


@pytest.mark.parametrize("case", CATALOGUE, ids=[case.name for case in CATALOGUE])
def test_bad_input_is_refused_without_effect(case: Bad, client: AppClient, db_url: str) -> None:
    answer = case.send(client)
    assert answer.status_code < 500
    assert answer.status_code == case.status, answer.text
    assert "error" in answer.json()
    assert answer.headers[RETENTION_HEADER] == RETENTION
    assert count_effects(db_url) == 0
    assert stored_receipts(db_url) == {}


def test_bad_input_collision_changes_nothing(
    client: AppClient, store: ReceiptStore, db_url: str
) -> None:
    answer = _collision(client, store)
    assert answer.status_code == 409
    assert count_effects(db_url) == 1  # the first receipt's, none from the colliding one
    assert stored_receipts(db_url) == {"r-bad": b'{"first":true}'}


def test_a_valid_body_of_any_json_type_is_accepted(client: AppClient) -> None:
    for index, body in enumerate([b"[1,2]", b'"text"', b"17", b"null", json.dumps({"é": "✓"})]):
        data = body if isinstance(body, bytes) else body.encode()
        assert post(client, f"r-{index}", data).status_code == 200


@pytest.mark.parametrize(
    "repeated", ["webhook-signature", "webhook-id", "webhook-timestamp", "content-type"]
)
@pytest.mark.parametrize("path", ["/replies", "/replies/batch", "/replies/dup-1"])
def test_a_repeated_security_header_is_refused_on_every_endpoint(
    client: AppClient, db_url: str, repeated: str, path: str
) -> None:
    body = b"{}" if path != "/replies/batch" else b'{"replies":[{"reply_id":"d","body":"{}"}]}'
    webhook_id = "batch:1-1-1" if path == "/replies/batch" else "dup-1"
    method = "GET" if path == "/replies/dup-1" else "POST"
    headers = list(signed(webhook_id, b"" if method == "GET" else body).items())
    # A second copy after the valid one: read first by one layer, last by another.
    other = dict(signed("dup-2", b"other")) | {"content-type": "text/plain"}
    headers.append((repeated, other[repeated]))
    answer = client.request(
        method, path, content=body if method == "POST" else None, headers=headers
    )
    assert answer.status_code == 400
    assert answer.json() == {"error": f"header {repeated} appears more than once"}
    assert stored_receipts(db_url) == {}
