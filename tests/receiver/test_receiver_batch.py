"""POST /replies/batch: one transaction, per-item dedupe, the same request rules as /replies."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.receiver_helpers import (
    SECRET,
    AppClient,
    count_effects,
    effects_refused,
    signed,
    stored_receipts,
)

from outbox.signing import parse_secret
from receiver import ReceiptStore, create_app
from receiver.effects import REPLY_ID_KEY, record_effect
from receiver.rules import MAX_BATCH_ITEMS, receiver_rules


def batch_body(*items: tuple[str, str]) -> bytes:
    """A batch request carrying (reply_id, exact body text) items."""
    return json.dumps({"replies": [{"reply_id": i, "body": b} for i, b in items]}).encode()


def post(client: AppClient, body: bytes, **overrides: object) -> tuple[int, object]:
    """POST a signed batch; returns status and decoded JSON."""
    headers = signed("batch:1-3-3", body)
    headers.update({k: str(v) for k, v in overrides.items()})
    response = client.post("/replies/batch", content=body, headers=headers)
    return response.status_code, response.json()


def test_batch_stores_dedupes_and_flags_each_item(db_url: str, store: ReceiptStore) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    first = batch_body(("r-1", '{"a":1}'), ("r-2", '{"a":2}'), ("r-3", "[1,2]"))
    assert post(client, first) == (
        200,
        {
            "results": [
                {"reply_id": "r-1", "status": "stored"},
                {"reply_id": "r-2", "status": "stored"},
                {"reply_id": "r-3", "status": "stored"},
            ]
        },
    )
    again = batch_body(
        ("r-1", '{"a":1}'),  # same bytes: duplicate
        ("r-2", '{"a":22}'),  # other bytes: conflict, first receipt kept
        ("bad.id", "{}"),  # '.' is not allowed in a reply_id
        ("r-4", "{NaN}"),  # not strict JSON
        ("r-5", '{"b":5}'),  # new
    )
    status, answer = post(client, again)
    assert status == 200
    assert [r["status"] for r in answer["results"]] == [  # type: ignore[index]
        "duplicate",
        "conflict",
        "invalid",
        "invalid",
        "stored",
    ]
    assert stored_receipts(db_url) == {
        "r-1": b'{"a":1}',
        "r-2": b'{"a":2}',
        "r-3": b"[1,2]",
        "r-5": b'{"b":5}',
    }
    assert count_effects(db_url) == 4
    assert all(count_effects(db_url, i) == 1 for i in ("r-1", "r-2", "r-3", "r-5"))


def test_batch_commits_all_items_or_none(db_url: str, store: ReceiptStore) -> None:
    def failing_on_second(session: Session, body: bytes) -> None:
        if session.info[REPLY_ID_KEY] == "r-2":
            raise RuntimeError("integrator bug")
        record_effect(session, body)

    with pytest.raises(RuntimeError, match="integrator bug"):
        store.accept_many([("r-1", b"{}"), ("r-2", b"{}")], effect=failing_on_second)
    assert stored_receipts(db_url) == {}
    assert count_effects(db_url) == 0


def keyed_batch_body(*items: tuple[str, str, object]) -> bytes:
    """A batch request carrying (reply_id, exact body text, ordering key or None) items."""
    replies = [
        {"reply_id": i, "body": b} if k is None else {"reply_id": i, "body": b, "ordering_key": k}
        for i, b, k in items
    ]
    return json.dumps({"replies": replies}).encode()


def test_a_failing_effect_answers_retry_and_holds_back_only_its_key(
    db_url: str, store: ReceiptStore
) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    body = keyed_batch_body(
        ("a1", '{"a":1}', "A"),
        ("a2", '{"a":2}', "A"),
        ("b1", '{"b":1}', "B"),
        ("u1", '{"u":1}', None),
        ("a3", '{"a":3}', "A"),
        ("b2", '{"b":2}', "B"),
    )
    with effects_refused(db_url, ["a2"]) as let_through:
        status, answer = post(client, body)
        assert status == 200
        results = answer["results"]  # type: ignore[index]
        assert [r["status"] for r in results] == [
            "stored",
            "retry",
            "stored",
            "stored",
            "held",
            "stored",
        ]
        assert results[1]["error"].startswith("effect raised ")
        assert all("error" not in r for i, r in enumerate(results) if i != 1)
        assert set(stored_receipts(db_url)) == {"a1", "b1", "u1", "b2"}
        let_through()
        # The relay sends the two again, in order: now both are applied.
        status, answer = post(
            client, keyed_batch_body(("a2", '{"a":2}', "A"), ("a3", '{"a":3}', "A"))
        )
    assert (status, [r["status"] for r in answer["results"]]) == (200, ["stored", "stored"])  # type: ignore[index]
    assert count_effects(db_url) == 6


@pytest.mark.parametrize("key", ["", "x" * 201, "tab\there", "é", 7, ["A"]])
def test_a_malformed_ordering_key_makes_its_item_invalid(
    db_url: str, store: ReceiptStore, key: object
) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    body = keyed_batch_body(("r-1", "{}", key), ("r-2", "{}", "x" * 200), ("r-3", "{}", " ~"))
    status, answer = post(client, body)
    assert (status, [r["status"] for r in answer["results"]]) == (  # type: ignore[index]
        200,
        ["invalid", "stored", "stored"],
    )
    assert set(stored_receipts(db_url)) == {"r-2", "r-3"}


def test_a_failing_effect_fails_only_its_own_message_in_a_group_commit(
    db_url: str, store: ReceiptStore
) -> None:
    keys = [parse_secret(SECRET)]
    rules = receiver_rules(store, keys, tolerance=300, max_body=1024, effect=record_effect)
    with effects_refused(db_url, ["r-2"]):
        answers = rules.store_messages([("r-1", b"{}"), ("r-2", b"{}"), ("r-3", b"{}")])
    assert [a.status for a in answers] == [200, 500, 200]
    assert answers[1].document["error"].startswith("effect raised ")  # type: ignore[index]
    assert set(stored_receipts(db_url)) == {"r-1", "r-3"}


BAD_REQUESTS = {
    "unsigned": (batch_body(("r-1", "{}")), {"webhook-signature": "v1,AAAA"}, 401),
    "wrong content type": (batch_body(("r-1", "{}")), {"content-type": "text/plain"}, 415),
    "not JSON": (b"{replies", {}, 400),
    "duplicate keys": (b'{"replies":[],"replies":[]}', {}, 400),
    "top level is a list": (b"[]", {}, 400),
    "no replies key": (b'{"items":[]}', {}, 400),
    "empty replies": (b'{"replies":[]}', {}, 400),
    "replies not a list": (b'{"replies":{}}', {}, 400),
    "too many items": (
        batch_body(*[(f"r-{n}", "{}") for n in range(MAX_BATCH_ITEMS + 1)]),
        {},
        400,
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_batch_requests_are_refused_without_effects(
    case: str, db_url: str, store: ReceiptStore
) -> None:
    body, overrides, expected = BAD_REQUESTS[case]
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    status, _ = post(client, body, **overrides)
    assert status == expected
    assert stored_receipts(db_url) == {}
    assert count_effects(db_url) == 0


def test_oversized_batch_is_413(db_url: str, store: ReceiptStore) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], max_body=64, effect=record_effect))
    status, _ = post(client, batch_body(*[(f"r-{n}", "{}") for n in range(10)]))
    assert status == 413
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("select count(*) from receiver_receipts")).scalar() == 0


def test_a_captured_request_cannot_be_replayed_to_the_other_endpoint(
    db_url: str, store: ReceiptStore
) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    batch = batch_body(("r-1", '{"a":1}'))
    batch_headers = signed("batch:1-1-1", batch)
    # A batch request sent to /replies would store the whole batch as one message.
    replayed = client.post("/replies", content=batch, headers=batch_headers)
    assert replayed.status_code == 400
    assert "batch" in replayed.json()["error"]
    # A single reply whose body has the batch shape, sent to /replies/batch.
    single = batch_body(("r-2", '{"b":2}'))
    single_headers = signed("order-7", single)
    assert client.post("/replies", content=single, headers=single_headers).status_code == 200
    replayed = client.post("/replies/batch", content=single, headers=single_headers)
    assert replayed.status_code == 400
    assert "must start with 'batch:'" in replayed.json()["error"]
    assert stored_receipts(db_url) == {"order-7": single}
    assert count_effects(db_url) == 1
    # No message may take a batch id, even in a batch.
    sneaky = batch_body(("batch:9-9-1", "{}"))
    assert post(client, sneaky) == (
        200,
        {"results": [{"reply_id": "batch:9-9-1", "status": "invalid"}]},
    )


def test_batch_items_may_carry_their_headers_as_strings(db_url: str, store: ReceiptStore) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    items = [
        {"reply_id": "h-1", "body": "{}", "headers": {"traceparent": "00-ab-cd-01"}},
        {"reply_id": "h-2", "body": "{}", "headers": {"x": 1}},
        {"reply_id": "h-3", "body": "{}", "headers": ["x"]},
    ]
    status, answer = post(client, json.dumps({"replies": items}).encode())
    assert status == 200
    assert [r["status"] for r in answer["results"]] == ["stored", "invalid", "invalid"]  # type: ignore[index]


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1.5e999"])
def test_a_number_that_overflows_to_infinity_is_refused(store: ReceiptStore, number: str) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    body = ('{"x":' + number + "}").encode()
    response = client.post("/replies", content=body, headers=signed("inf-1", body))
    assert response.status_code == 400
    assert "out of range" in response.json()["error"]
    status, answer = post(client, batch_body(("inf-2", body.decode())))
    assert (status, answer["results"][0]["status"]) == (200, "invalid")  # type: ignore[index]


def test_the_answer_is_written_as_json_dumps_writes_it(store: ReceiptStore) -> None:
    client = AppClient(create_app(store, secrets=[SECRET], effect=record_effect))
    items = [
        {"reply_id": 'q"uote\\s', "body": "{}"},  # a valid reply_id that needs escaping
        {"reply_id": "bad id é\n\u2028\x7f", "body": "{}"},
        {"reply_id": 7, "body": "{}"},
        {"body": "{}"},
        "not an object",
        {"reply_id": 'q"uote\\s', "body": "{}"},
    ]
    body = json.dumps({"replies": items}).encode()
    response = client.post("/replies/batch", content=body, headers=signed("batch:1-6-6", body))
    expected = {
        "results": [
            {"reply_id": 'q"uote\\s', "status": "stored"},
            {"reply_id": "bad id é\n\u2028\x7f", "status": "invalid"},
            {"reply_id": "", "status": "invalid"},
            {"reply_id": "", "status": "invalid"},
            {"reply_id": "", "status": "invalid"},
            {"reply_id": 'q"uote\\s', "status": "duplicate"},
        ]
    }
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == json.dumps(
        expected, ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode("utf-8")
