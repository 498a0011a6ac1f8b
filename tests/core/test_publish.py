"""publish() conformance (docs/explanation/contract.md): caller's transaction, identity, checks."""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any

import pytest
from sqlalchemy.orm import Session

from outbox import AuthContext, Envelope, InvalidMessage, PayloadCollision, TaskQueue, publish
from outbox.testing import ManualClock

BODY = {"order": 17, "status": "confirmed", "lines": [{"sku": "a", "qty": 2}]}


def canonical(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def publish_committed(queue: TaskQueue, clock: ManualClock, **fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "destination": "billing",
        "reply_id": "order-17:confirmed",
        "body": BODY,
    }
    values.update(fields)
    with Session(queue.engine) as session:
        row = publish(session, clock=clock, **values)
        session.commit()
    return row


def test_publish_commits_only_with_the_callers_transaction(
    queue: TaskQueue, clock: ManualClock
) -> None:
    with Session(queue.engine) as session:
        row = publish(
            session,
            destination="billing",
            reply_id="order-17:confirmed",
            body=BODY,
            ordering_key="order-17",
            clock=clock,
        )
        assert row["reply_id"] == "order-17:confirmed"
        assert queue.messages() == []  # not visible before the caller commits
        session.commit()
    [stored] = queue.messages()
    body = canonical(BODY)
    assert stored["body"] == body
    assert stored["content_hash"] == hashlib.sha256(body).hexdigest()
    assert (
        stored["reply_id"],
        stored["destination"],
        stored["ordering_key"],
        stored["task_id"],
        stored["state"],
        stored["attempts"],
        stored["headers"],
    ) == ("order-17:confirmed", "billing", "order-17", None, "pending", 0, {})
    assert stored["available_at"] == clock()
    assert stored["id"] == row["id"]


def test_rolled_back_publish_leaves_nothing(queue: TaskQueue, clock: ManualClock) -> None:
    with Session(queue.engine) as session:
        publish(session, "billing", "order-17:confirmed", BODY, clock=clock)
        publish(session, "billing", "order-18:confirmed", BODY, clock=clock)
        session.rollback()
    assert queue.messages() == []
    # The key is free again: nothing of the rolled-back attempt remains.
    publish_committed(queue, clock, body={"other": True})
    [stored] = queue.messages()
    assert stored["body"] == canonical({"other": True})


def test_unclosed_session_without_commit_publishes_nothing(
    queue: TaskQueue, clock: ManualClock
) -> None:
    with Session(queue.engine) as session:
        publish(session, "billing", "order-17:confirmed", BODY, clock=clock)
    assert queue.messages() == []


def test_same_key_and_body_returns_the_existing_row(queue: TaskQueue, clock: ManualClock) -> None:
    first = publish_committed(queue, clock)
    clock.advance(5)
    reordered = {"lines": [{"qty": 2, "sku": "a"}], "status": "confirmed", "order": 17}
    second = publish_committed(queue, clock, body=reordered)
    assert second["id"] == first["id"]
    assert second["created_at"] == first["created_at"]
    assert second["body"] == canonical(BODY)
    [stored] = queue.messages()
    assert stored["id"] == first["id"]


def test_same_key_twice_in_one_transaction_is_one_row(queue: TaskQueue, clock: ManualClock) -> None:
    with Session(queue.engine) as session:
        first = publish(session, "billing", "k-1", BODY, clock=clock)
        second = publish(session, "billing", "k-1", BODY, clock=clock)
        assert second["id"] == first["id"]
        session.commit()
    assert len(queue.messages()) == 1


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"body": {**BODY, "status": "cancelled"}}, id="other-body"),
        pytest.param({"body": {**BODY, "order": 17.0}}, id="int-vs-float"),
        pytest.param({"body": [BODY]}, id="wrapped-body"),
        pytest.param({"destination": "shipping"}, id="other-destination"),
        pytest.param({"ordering_key": "order-17"}, id="other-ordering-key"),
    ],
)
def test_same_key_with_other_content_is_a_collision(
    queue: TaskQueue, clock: ManualClock, change: dict[str, Any]
) -> None:
    publish_committed(queue, clock)
    before = queue.messages()
    with pytest.raises(PayloadCollision):
        publish_committed(queue, clock, **change)
    assert queue.messages() == before


def test_task_reply_ids_are_reserved(queue: TaskQueue, clock: ManualClock) -> None:
    """A published "reply:<task_id>" would make that task's terminal reply impossible to write."""
    ack = queue.receive(AuthContext("agent-a"), Envelope("m-1", "agent-a", {"n": 1}, clock() + 60))
    squat = {"destination": "default", "reply_id": "reply:" + ack.task_id, "body": {"x": 1}}
    with pytest.raises(InvalidMessage, match="reserved"):
        publish_committed(queue, clock, **squat)
    with pytest.raises(InvalidMessage, match="reserved"):
        publish_committed(queue, clock, reply_id="reply:anything")
    assert queue.messages() == []
    claim = queue.claim("w")
    assert claim is not None
    queue.finish(claim, "done")
    [reply] = queue.messages()
    assert reply["reply_id"] == "reply:" + ack.task_id
    with pytest.raises(InvalidMessage, match="reserved"):
        publish_committed(
            queue,
            clock,
            destination="default",
            reply_id=reply["reply_id"],
            body=json.loads(reply["body"]),
        )
    assert queue.messages() == [reply]


def test_batch_request_ids_are_reserved(queue: TaskQueue, clock: ManualClock) -> None:
    """A message named "batch:..." could be confused with a batch request at a receiver."""
    with pytest.raises(InvalidMessage, match="not starting with 'batch:'"):
        publish_committed(queue, clock, reply_id="batch:1-2-2")
    assert queue.messages() == []


@pytest.mark.parametrize("number", [float("inf"), float("-inf"), float("nan")])
def test_a_body_that_is_not_finite_json_is_refused(
    queue: TaskQueue, clock: ManualClock, number: float
) -> None:
    with pytest.raises(InvalidMessage):
        publish_committed(queue, clock, body={"x": number})
    assert queue.messages() == []


def test_without_a_clock_times_come_from_the_database(queue: TaskQueue) -> None:
    with Session(queue.engine) as session:
        publish(session, "billing", "k-1", BODY)
        session.commit()
    [stored] = queue.messages()
    assert abs(stored["created_at"] - time.time()) < 300


@pytest.mark.parametrize(
    "reply_id",
    [
        pytest.param("x", id="one-char"),
        pytest.param("x" * 200, id="200-chars"),
        pytest.param("!\"#$%&'()*+,-/:;<=>?@[\\]^_`{|}~", id="all-punctuation-but-dot"),
        pytest.param("order:17", id="colon"),
        pytest.param("Reply:17", id="not-the-reserved-prefix"),
    ],
)
def test_valid_reply_ids(queue: TaskQueue, clock: ManualClock, reply_id: str) -> None:
    row = publish_committed(queue, clock, reply_id=reply_id)
    assert row["reply_id"] == reply_id
    assert [r["reply_id"] for r in queue.messages()] == [reply_id]


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"reply_id": ""}, id="reply_id-empty"),
        pytest.param({"reply_id": "x" * 201}, id="reply_id-201"),
        pytest.param({"reply_id": "order.17"}, id="reply_id-dot"),
        pytest.param({"reply_id": "order 17"}, id="reply_id-space"),
        pytest.param({"reply_id": "order\t17"}, id="reply_id-tab"),
        pytest.param({"reply_id": "order-17\n"}, id="reply_id-trailing-newline"),
        pytest.param({"reply_id": "commandé"}, id="reply_id-non-ascii"),
        pytest.param({"reply_id": "order\x0017"}, id="reply_id-nul"),
        pytest.param({"reply_id": "order\x1b17"}, id="reply_id-escape"),
        pytest.param({"reply_id": "order\x7f17"}, id="reply_id-del"),
        pytest.param({"reply_id": 17}, id="reply_id-int"),
        pytest.param({"reply_id": None}, id="reply_id-none"),
        pytest.param({"destination": "http://x"}, id="destination-url"),
        pytest.param({"destination": "https://example.com/replies"}, id="destination-https-url"),
        pytest.param({"destination": ""}, id="destination-empty"),
        pytest.param({"destination": "bill ing"}, id="destination-space"),
        pytest.param({"destination": "billing/v2"}, id="destination-slash"),
        pytest.param({"destination": "x" * 201}, id="destination-201"),
        pytest.param({"destination": None}, id="destination-none"),
        pytest.param({"body": {"x": math.nan}}, id="body-nan"),
        pytest.param({"body": math.inf}, id="body-inf"),
        pytest.param({"body": {1: "int key"}}, id="body-int-key"),
        pytest.param({"body": {1, 2}}, id="body-set"),
        pytest.param({"body": b"{}"}, id="body-bytes"),
        pytest.param({"body": (1, 2)}, id="body-tuple"),
        pytest.param({"body": {"x": object()}}, id="body-object"),
        pytest.param({"body": {"x": "\udc80"}}, id="body-lone-surrogate"),
    ],
)
def test_invalid_publish_adds_nothing(
    queue: TaskQueue, clock: ManualClock, fields: dict[str, Any]
) -> None:
    values: dict[str, Any] = {"destination": "billing", "reply_id": "order-17", "body": BODY}
    values.update(fields)
    with Session(queue.engine) as session:
        with pytest.raises(InvalidMessage) as raised:
            publish(session, clock=clock, **values)
        assert isinstance(raised.value, ValueError)
        session.commit()
    assert queue.messages() == []


@pytest.mark.parametrize(
    ("headers", "said"),
    [
        ({f"x-h{n}": "v" for n in range(33)}, "at most 32 headers"),
        ({f"x-h{n}": "v" * 4000 for n in range(5)}, "more than 16384"),
    ],
)
def test_headers_are_capped_in_count_and_size(
    queue: TaskQueue, clock: ManualClock, headers: dict[str, str], said: str
) -> None:
    with pytest.raises(InvalidMessage, match=said):
        publish_committed(queue, clock, headers=headers)
    assert queue.messages() == []
    largest = {f"x-h{n}": "v" * 500 for n in range(32)}
    assert publish_committed(queue, clock, headers=largest)["headers"] == largest


@pytest.mark.parametrize(
    ("headers", "said"),
    [({1: "x"}, "invalid header name"), ([("x-a", "1")], "must be a mapping")],
)
def test_headers_of_the_wrong_shape_are_refused_as_invalid(
    queue: TaskQueue, clock: ManualClock, headers: Any, said: str
) -> None:
    with pytest.raises(InvalidMessage, match=said):
        publish_committed(queue, clock, headers=headers)
    assert queue.messages() == []


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("Webhook-Signature", "set by the relay"),
        ("Outbox-Ordering-Key", "set by the relay"),
        ("Nats-Msg-Id", "NATS JetStream's own"),
        ("Status", "read it as a server status"),
        ("DESCRIPTION", "read it as a server status"),
    ],
)
def test_header_names_the_relay_or_nats_reads_are_refused(
    queue: TaskQueue, clock: ManualClock, name: str, said: str
) -> None:
    with pytest.raises(InvalidMessage, match=said):
        publish_committed(queue, clock, headers={name: "500"})
    assert queue.messages() == []


def test_headers_are_not_part_of_the_identity(queue: TaskQueue, clock: ManualClock) -> None:
    first = publish_committed(queue, clock, headers={"x-a": "1"})
    again = publish_committed(queue, clock, headers={"x-a": "2"})
    assert again["headers"] == first["headers"]
    [stored] = queue.messages()
    assert stored["headers"] == {"x-a": "1"}
