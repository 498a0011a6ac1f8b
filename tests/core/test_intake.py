"""Intake conformance: validation, authorization, identity, batches.

The rules: docs/explanation/contract.md, "Identity and canonical form" and "Intake limits".

Every rejected envelope must raise the documented error and leave the database
untouched: no inbox row, no task, no reply.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

import outbox
from outbox import (
    Ack,
    AuthContext,
    BatchFailed,
    Envelope,
    InvalidEnvelope,
    PayloadCollision,
    TaskQueue,
    Unauthorized,
)
from outbox.testing import ManualClock

A = AuthContext("agent-a")
B = AuthContext("agent-b")
START = 1_000_000.0  # the conftest clock's start; asserted in `fresh_clock`
DEADLINE = START + 3600


@pytest.fixture(autouse=True)
def fresh_clock(clock: ManualClock) -> None:
    """The table below builds deadlines from START: make sure the clock agrees."""
    assert clock() == START


# --- helpers -----------------------------------------------------------------


def envelope(message_id: str = "m-1", sender: str = "agent-a", **fields: Any) -> Envelope:
    values: dict[str, Any] = {"payload": {"n": 1}, "deadline": DEADLINE}
    values.update(fields)
    return Envelope(message_id=message_id, sender=sender, **values)


def canonical(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def expected_task_id(principal: str, message_id: str) -> str:
    return hashlib.sha256(canonical([principal, message_id])).hexdigest()


def rows(queue: TaskQueue, table: str) -> list[dict[str, Any]]:
    with queue.engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(f"SELECT * FROM {table}")).mappings()]


def assert_nothing_written(queue: TaskQueue) -> None:
    assert rows(queue, "outbox_inbox") == []
    assert rows(queue, "outbox_tasks") == []
    assert queue.messages() == []


def snapshot(queue: TaskQueue) -> tuple[Any, ...]:
    return (
        rows(queue, "outbox_inbox"),
        rows(queue, "outbox_tasks"),
        queue.messages(),
    )


def container_depth(value: Any) -> int:
    """Containers on the deepest path: {} is 1, {"a": [1]} is 2."""
    if isinstance(value, dict):
        return 1 + max((container_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((container_depth(v) for v in value), default=0)
    return 0


def deep(depth: int) -> dict[str, Any]:
    """`depth` nested dicts."""
    payload: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        payload = {"d": payload}
    assert container_depth(payload) == depth
    return payload


def deep_mixed(depth: int) -> dict[str, Any]:
    """Depth `depth`, alternating dicts and lists; the outermost is a dict."""
    inner: Any = 1
    for level in range(depth):
        outermost = level == depth - 1
        inner = {"k": inner} if (outermost or level % 2 == 0) else [inner]
    assert isinstance(inner, dict)
    assert container_depth(inner) == depth
    return inner


def with_nodes(count: int) -> dict[str, Any]:
    """A payload of exactly `count` JSON values: the dict, one list and count - 2 numbers."""
    return {"items": list(range(count - 2))}


def of_canonical_size(size: int, char: str = "x") -> dict[str, Any]:
    """A payload whose canonical JSON is `size` bytes (char is 1 or 3 UTF-8 bytes)."""
    overhead = len(canonical({"s": ""}))
    width = len(char.encode("utf-8"))
    count, rest = divmod(size - overhead, width)
    text = char * count + "y" * rest
    payload = {"s": text}
    assert len(canonical(payload)) == size
    return payload


def cyclic_dict() -> dict[str, Any]:
    payload: dict[str, Any] = {"a": 1}
    payload["self"] = payload
    return payload


def cyclic_list() -> dict[str, Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return {"loop": loop}


# --- validation table --------------------------------------------------------

INVALID = [
    # message_id
    pytest.param({"message_id": 17}, id="message_id-int"),
    pytest.param({"message_id": None}, id="message_id-none"),
    pytest.param({"message_id": b"m-1"}, id="message_id-bytes"),
    pytest.param({"message_id": ""}, id="message_id-empty"),
    pytest.param({"message_id": "x" * 129}, id="message_id-129-ascii-bytes"),
    pytest.param({"message_id": "€" * 43}, id="message_id-129-utf8-bytes"),
    pytest.param({"message_id": "m-\ud800"}, id="message_id-lone-surrogate"),
    pytest.param({"message_id": "m\x00-1"}, id="message_id-nul"),
    # kind
    pytest.param({"kind": "result"}, id="kind-result"),
    pytest.param({"kind": ""}, id="kind-empty"),
    pytest.param({"kind": "TASK"}, id="kind-uppercase"),
    # deadline
    pytest.param({"deadline": True}, id="deadline-bool"),
    pytest.param({"deadline": str(DEADLINE)}, id="deadline-str"),
    pytest.param({"deadline": None}, id="deadline-none"),
    pytest.param({"deadline": math.nan}, id="deadline-nan"),
    pytest.param({"deadline": math.inf}, id="deadline-inf"),
    pytest.param({"deadline": -math.inf}, id="deadline-minus-inf"),
    pytest.param({"deadline": 10**400}, id="deadline-int-overflows-float"),
    pytest.param(
        {"deadline": datetime.fromtimestamp(DEADLINE, UTC).replace(tzinfo=None)},
        id="deadline-naive-datetime",
    ),
    # payload: type and JSON-safety
    pytest.param({"payload": [1, 2]}, id="payload-list"),
    pytest.param({"payload": "text"}, id="payload-str"),
    pytest.param({"payload": None}, id="payload-none"),
    pytest.param({"payload": (("a", 1),)}, id="payload-tuple"),
    pytest.param({"payload": {1: "one"}}, id="payload-int-key"),
    pytest.param({"payload": {"a": {None: 1}}}, id="payload-nested-none-key"),
    pytest.param({"payload": {"t": (1, 2)}}, id="payload-tuple-inside"),
    pytest.param({"payload": {"s": {1, 2}}}, id="payload-set-inside"),
    pytest.param({"payload": {"b": b"bytes"}}, id="payload-bytes-inside"),
    pytest.param({"payload": {"x": math.nan}}, id="payload-nan"),
    pytest.param({"payload": {"x": [1, math.inf]}}, id="payload-inf"),
    pytest.param({"payload": {"nul": "a\x00b"}}, id="payload-nul-in-string"),
    pytest.param({"payload": {"a\x00": 1}}, id="payload-nul-in-key"),
    pytest.param({"payload": {"x": -math.inf}}, id="payload-minus-inf"),
    pytest.param({"payload": {"x": datetime(2024, 1, 1, tzinfo=UTC)}}, id="payload-datetime"),
    pytest.param({"payload": {"x": object()}}, id="payload-object"),
    pytest.param({"payload": {"x": "bad \udc80"}}, id="payload-lone-surrogate-value"),
    pytest.param({"payload": {"bad \ud800": 1}}, id="payload-lone-surrogate-key"),
    pytest.param({"payload": deep_mixed(17)}, id="payload-depth-17"),
    pytest.param({"payload": deep(17)}, id="payload-depth-17-dicts"),
    pytest.param({"payload": with_nodes(10_001)}, id="payload-10001-nodes"),
    pytest.param({"payload": with_nodes(20_000)}, id="payload-20000-nodes"),
    pytest.param({"payload": of_canonical_size(64 * 1024 + 1)}, id="payload-64KiB-plus-1"),
    pytest.param(
        {"payload": of_canonical_size(64 * 1024 + 1, "€")}, id="payload-64KiB-plus-1-utf8"
    ),
    pytest.param({"payload": cyclic_dict()}, id="payload-cycle-dict"),
    pytest.param({"payload": cyclic_list()}, id="payload-cycle-list"),
    # max_attempts
    pytest.param({"max_attempts": 0}, id="max_attempts-0"),
    pytest.param({"max_attempts": 11}, id="max_attempts-11"),
    pytest.param({"max_attempts": -1}, id="max_attempts-negative"),
    pytest.param({"max_attempts": True}, id="max_attempts-bool"),
    pytest.param({"max_attempts": 2.0}, id="max_attempts-float"),
    pytest.param({"max_attempts": "3"}, id="max_attempts-str"),
    pytest.param({"max_attempts": None}, id="max_attempts-none"),
    # hops
    pytest.param({"hops": -1}, id="hops-negative"),
    pytest.param({"hops": 2**31}, id="hops-2**31"),
    pytest.param({"hops": True}, id="hops-bool"),
    pytest.param({"hops": 1.0}, id="hops-float"),
    # priority
    pytest.param({"priority": True}, id="priority-bool"),
    pytest.param({"priority": False}, id="priority-false"),
    pytest.param({"priority": 1.5}, id="priority-float"),
    pytest.param({"priority": 2**31}, id="priority-above-int32"),
    pytest.param({"priority": -(2**31) - 1}, id="priority-below-int32"),
]


@pytest.mark.parametrize("fields", INVALID)
def test_invalid_envelope_is_rejected_and_nothing_is_written(
    queue: TaskQueue, fields: dict[str, Any]
) -> None:
    with pytest.raises(InvalidEnvelope) as raised:
        queue.receive(A, envelope(**fields))
    assert isinstance(raised.value, ValueError)
    assert_nothing_written(queue)


@pytest.mark.parametrize("fields", INVALID[:4])
def test_invalid_envelope_in_a_batch_writes_nothing(
    queue: TaskQueue, fields: dict[str, Any]
) -> None:
    with pytest.raises(BatchFailed) as raised:
        queue.receive_batch(A, [envelope(**fields)])
    assert (raised.value.index, raised.value.committed) == (0, [])
    assert isinstance(raised.value.cause, InvalidEnvelope)
    assert_nothing_written(queue)


VALID_BOUNDARIES = [
    pytest.param({"message_id": "x"}, id="message_id-1-byte"),
    pytest.param({"message_id": "x" * 128}, id="message_id-128-ascii"),
    pytest.param({"message_id": "€" * 42 + "ab"}, id="message_id-128-utf8-bytes"),
    pytest.param({"message_id": "é" * 64}, id="message_id-128-bytes-2-byte-chars"),
    pytest.param({"deadline": int(DEADLINE)}, id="deadline-int"),
    pytest.param({"deadline": DEADLINE + 0.25}, id="deadline-float"),
    pytest.param(
        {"deadline": datetime.fromtimestamp(DEADLINE, timezone(timedelta(hours=-5)))},
        id="deadline-aware-non-utc",
    ),
    pytest.param({"payload": {}}, id="payload-empty"),
    pytest.param({"payload": deep_mixed(16)}, id="payload-depth-16"),
    pytest.param({"payload": deep(16)}, id="payload-depth-16-dicts"),
    pytest.param({"payload": with_nodes(10_000)}, id="payload-10000-nodes"),
    pytest.param({"payload": of_canonical_size(64 * 1024)}, id="payload-64KiB"),
    pytest.param({"payload": of_canonical_size(64 * 1024, "€")}, id="payload-64KiB-utf8"),
    pytest.param(
        {"payload": {"a": [1, 2], "b": [1, 2], "z": None, "t": True, "f": -0.5, "u": "ü€😀"}},
        id="payload-json-types",
    ),
    pytest.param(
        {"payload": {"big": 2**70, "neg": -(2**70), "tiny": 5e-324}}, id="payload-big-ints"
    ),
    pytest.param({"payload": {"ctl": "\x01\x1b\x7f"}}, id="payload-control-chars"),
    pytest.param({"max_attempts": 1}, id="max_attempts-1"),
    pytest.param({"max_attempts": 10}, id="max_attempts-10"),
    pytest.param({"hops": 0}, id="hops-0"),
    pytest.param({"hops": 3}, id="hops-3"),
    pytest.param({"priority": -(2**31)}, id="priority-min"),
    pytest.param({"priority": 2**31 - 1}, id="priority-max"),
]


@pytest.mark.parametrize("fields", VALID_BOUNDARIES)
def test_valid_boundary_envelope_is_stored_as_pending(
    queue: TaskQueue, fields: dict[str, Any]
) -> None:
    env = envelope(**fields)
    ack = queue.receive(A, env)
    assert (ack.ack, ack.duplicate) == ("stored", False)
    assert ack.task_id == expected_task_id("agent-a", env.message_id)
    task = queue.task(ack.task_id)
    assert task is not None
    assert task["state"] == "pending"
    assert task["payload"] == env.payload
    assert len(rows(queue, "outbox_inbox")) == 1
    assert queue.messages() == []


class DuckEnvelope:
    """Has every Envelope field but is not an Envelope."""

    message_id = "m-1"
    sender = "agent-a"
    payload: dict[str, Any] = {"n": 1}  # noqa: RUF012
    deadline = DEADLINE
    max_attempts = 3
    hops = 0
    kind = "task"
    priority = 0


def test_envelope_must_be_an_envelope(queue: TaskQueue) -> None:
    with pytest.raises(InvalidEnvelope):
        queue.receive(A, DuckEnvelope())  # type: ignore[arg-type]
    assert_nothing_written(queue)


def test_shared_subobject_is_not_a_cycle(queue: TaskQueue) -> None:
    shared = {"x": [1, 2]}
    ack = queue.receive(A, envelope(payload={"a": shared, "b": shared, "c": [shared, shared]}))
    task = queue.task(ack.task_id)
    assert task is not None
    assert task["payload"] == {"a": shared, "b": shared, "c": [shared, shared]}


def test_hops_at_the_int32_limit_is_valid_and_over_the_hop_limit(queue: TaskQueue) -> None:
    ack = queue.receive(A, envelope(hops=2**31 - 1))
    task = queue.task(ack.task_id)
    assert task is not None
    assert task["state"] == "hop_limit"


# --- authorization -----------------------------------------------------------


class DuckAuth:
    """Looks like an AuthContext but was not built by a trusted adapter."""

    principal = "agent-a"
    tenant_id = None


UNAUTHORIZED = [
    pytest.param("agent-a", "agent-a", id="plain-string"),
    pytest.param(DuckAuth(), "agent-a", id="duck-typed"),
    pytest.param(None, "agent-a", id="none"),
    pytest.param({"principal": "agent-a"}, "agent-a", id="dict"),
    pytest.param(AuthContext("intruder"), "intruder", id="principal-not-allowed"),
    pytest.param(AuthContext(""), "", id="empty-principal"),
    pytest.param(AuthContext("Agent-A"), "Agent-A", id="principal-case-differs"),
    pytest.param(AuthContext("agent-b"), "agent-a", id="sender-is-another-allowed-source"),
    pytest.param(AuthContext("agent-a"), "agent-b", id="sender-differs"),
    pytest.param(AuthContext("agent-a"), "intruder", id="sender-not-allowed"),
    pytest.param(AuthContext(123), 123, id="principal-not-str"),
]


@pytest.mark.parametrize(("auth", "sender"), UNAUTHORIZED)
def test_unauthorized_caller_writes_nothing(queue: TaskQueue, auth: Any, sender: Any) -> None:
    with pytest.raises(Unauthorized):
        queue.receive(auth, envelope(sender=sender))
    assert_nothing_written(queue)


def test_unauthorized_is_checked_before_the_envelope(queue: TaskQueue) -> None:
    with pytest.raises(Unauthorized):
        queue.receive(AuthContext("intruder"), envelope(sender="intruder", kind="result"))
    assert_nothing_written(queue)


def test_unauthorized_batch_fails_at_index_zero(queue: TaskQueue) -> None:
    with pytest.raises(BatchFailed) as raised:
        queue.receive_batch(AuthContext("intruder"), [envelope(sender="intruder")])
    assert (raised.value.index, raised.value.committed) == (0, [])
    assert isinstance(raised.value.cause, Unauthorized)
    assert_nothing_written(queue)


def test_queue_without_allowed_sources_accepts_nobody(db_url: str, clock: ManualClock) -> None:
    with TaskQueue(db_url, clock=clock) as closed:
        with pytest.raises(Unauthorized):
            closed.receive(A, envelope())
        assert_nothing_written(closed)


# --- identity ------------------------------------------------------------------


@pytest.mark.parametrize("message_id", ["m-1", "m-€-ü", "x" * 128, '"quoted",[1]'])
def test_task_id_is_sha256_of_canonical_principal_and_message_id(
    queue: TaskQueue, message_id: str
) -> None:
    ack = queue.receive(A, envelope(message_id))
    assert ack.task_id == expected_task_id("agent-a", message_id)
    [row] = rows(queue, "outbox_inbox")
    assert (row["principal"], row["message_id"], row["task_id"]) == (
        "agent-a",
        message_id,
        ack.task_id,
    )
    assert row["content_hash"] == hashlib.sha256(row["content"].encode("utf-8")).hexdigest()
    content = json.loads(row["content"])
    assert canonical(content) == row["content"].encode("utf-8")
    assert (content["message_id"], content["sender"], content["payload"]) == (
        message_id,
        "agent-a",
        {"n": 1},
    )


def test_same_message_id_from_two_principals_is_two_tasks(queue: TaskQueue) -> None:
    ack_a = queue.receive(A, envelope("shared", "agent-a", payload={"from": "a"}))
    ack_b = queue.receive(B, envelope("shared", "agent-b", payload={"from": "b"}))
    assert ack_a.task_id != ack_b.task_id
    assert (ack_a.duplicate, ack_b.duplicate) == (False, False)
    assert ack_a.task_id == expected_task_id("agent-a", "shared")
    assert ack_b.task_id == expected_task_id("agent-b", "shared")
    task_a, task_b = queue.task(ack_a.task_id), queue.task(ack_b.task_id)
    assert task_a is not None
    assert task_b is not None
    assert (task_a["payload"], task_b["payload"]) == ({"from": "a"}, {"from": "b"})
    assert (task_a["tenant_id"], task_b["tenant_id"]) == ("agent-a", "agent-b")
    assert len(rows(queue, "outbox_tasks")) == 2


def test_same_envelope_twice_is_a_duplicate(queue: TaskQueue) -> None:
    first = queue.receive(A, envelope(payload={"a": 1, "b": [1, 2]}))
    before = snapshot(queue)
    second = queue.receive(A, envelope(payload={"b": [1, 2], "a": 1}))  # key order is not content
    assert (first.duplicate, second.duplicate) == (False, True)
    assert second.task_id == first.task_id
    assert second.ack == "stored"
    assert snapshot(queue) == before
    assert len(rows(queue, "outbox_tasks")) == 1


def test_duplicate_of_a_finished_task_changes_nothing(queue: TaskQueue) -> None:
    ack = queue.receive(A, envelope())
    claim = queue.claim("w")
    assert claim is not None
    queue.finish(claim, {"ok": True})
    before = snapshot(queue)
    again = queue.receive(A, envelope())
    assert (again.task_id, again.duplicate) == (ack.task_id, True)
    assert snapshot(queue) == before
    assert queue.claim("w") is None


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"payload": {"n": 2}}, id="payload"),
        pytest.param({"payload": {"n": 1.0}}, id="payload-int-vs-float"),
        pytest.param({"payload": {"n": 1, "extra": None}}, id="payload-extra-key"),
        pytest.param({"deadline": DEADLINE + 1}, id="deadline"),
        pytest.param({"max_attempts": 4}, id="max_attempts"),
        pytest.param({"hops": 1}, id="hops"),
        pytest.param({"priority": 9}, id="priority"),
    ],
)
def test_same_message_id_with_other_content_is_a_collision(
    queue: TaskQueue, change: dict[str, Any]
) -> None:
    ack = queue.receive(A, envelope())
    before = snapshot(queue)
    with pytest.raises(PayloadCollision):
        queue.receive(A, envelope(**change))
    assert snapshot(queue) == before
    task = queue.task(ack.task_id)
    assert task is not None
    assert (task["payload"], task["deadline"], task["state"]) == ({"n": 1}, DEADLINE, "pending")


@pytest.mark.parametrize(
    "deadline",
    [
        pytest.param(datetime.fromtimestamp(DEADLINE, UTC), id="utc"),
        pytest.param(datetime.fromtimestamp(DEADLINE, timezone(timedelta(hours=9))), id="plus9"),
        pytest.param(int(DEADLINE), id="int"),
    ],
)
def test_equal_deadlines_in_other_forms_are_duplicates(queue: TaskQueue, deadline: Any) -> None:
    first = queue.receive(A, envelope(deadline=DEADLINE))
    second = queue.receive(A, envelope(deadline=deadline))
    assert (second.task_id, second.duplicate) == (first.task_id, True)
    task = queue.task(first.task_id)
    assert task is not None
    assert task["deadline"] == DEADLINE


def test_aware_datetime_deadline_is_stored_as_epoch_seconds(queue: TaskQueue) -> None:
    when = datetime(2030, 5, 6, 7, 8, 9, 500000, tzinfo=timezone(timedelta(hours=2)))
    ack = queue.receive(A, envelope(deadline=when))
    task = queue.task(ack.task_id)
    assert task is not None
    assert task["deadline"] == when.timestamp()


# --- terminal at intake ---------------------------------------------------------


def reply_body(reply: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(reply["body"])
    return body


EXPIRED_AT_INTAKE = {"code": "deadline_passed", "reason": "deadline passed before intake"}


def assert_single_terminal_reply(
    queue: TaskQueue, task_id: str, status: str, error: dict[str, str]
) -> None:
    [reply] = queue.messages()
    expected = canonical(
        {"kind": "result", "task_id": task_id, "status": status, "result": None, "error": error}
    )
    assert reply["reply_id"] == "reply:" + task_id
    assert reply["task_id"] == task_id
    assert reply["body"] == expected
    assert reply["content_hash"] == hashlib.sha256(expected).hexdigest()
    assert (reply["state"], reply["destination"]) == ("pending", "default")


@pytest.mark.parametrize("offset", [-1.0, -3600.0, 0.0], ids=["1s-ago", "1h-ago", "exactly-now"])
def test_deadline_already_past_stores_an_expired_task_with_its_reply(
    queue: TaskQueue, clock: ManualClock, offset: float
) -> None:
    ack = queue.receive(A, envelope(deadline=clock() + offset))
    assert (ack.ack, ack.duplicate) == ("stored", False)
    task = queue.task(ack.task_id)
    assert task is not None
    assert (task["state"], task["attempts"], task["finished_at"]) == ("expired", 0, clock())
    assert_single_terminal_reply(queue, ack.task_id, "expired", EXPIRED_AT_INTAKE)
    assert queue.claim("w") is None
    again = queue.receive(A, envelope(deadline=clock() + offset))
    assert again.duplicate
    assert len(queue.messages()) == 1


def test_deadline_in_the_past_as_datetime_expires(queue: TaskQueue, clock: ManualClock) -> None:
    ack = queue.receive(A, envelope(deadline=datetime.fromtimestamp(clock() - 10, UTC)))
    task = queue.task(ack.task_id)
    assert task is not None
    assert task["state"] == "expired"
    assert_single_terminal_reply(queue, ack.task_id, "expired", EXPIRED_AT_INTAKE)


@pytest.mark.parametrize("hops", [4, 5, 1000])
def test_hops_at_or_over_max_hops_is_hop_limit_with_its_reply(queue: TaskQueue, hops: int) -> None:
    assert queue.max_hops == 4
    ack = queue.receive(A, envelope(hops=hops))
    task = queue.task(ack.task_id)
    assert task is not None
    assert (task["state"], task["hops"]) == ("hop_limit", hops)
    assert_single_terminal_reply(
        queue,
        ack.task_id,
        "hop_limit",
        {"code": "hop_limit", "reason": f"hops {hops} >= max_hops 4"},
    )
    assert queue.claim("w") is None


def test_hops_below_max_hops_is_pending(queue: TaskQueue) -> None:
    ack = queue.receive(A, envelope(hops=3))
    task = queue.task(ack.task_id)
    assert task is not None
    assert task["state"] == "pending"
    assert queue.messages() == []


def test_max_hops_is_configurable(db_url: str, clock: ManualClock) -> None:
    with TaskQueue(db_url, clock=clock, allowed_sources=("agent-a",), max_hops=2) as q:
        low = q.receive(A, envelope("low", hops=1))
        high = q.receive(A, envelope("high", hops=2))
        states = [(t or {}).get("state") for t in (q.task(low.task_id), q.task(high.task_id))]
        assert states == ["pending", "hop_limit"]


# --- batches ---------------------------------------------------------------------


def batch(count: int) -> list[Envelope]:
    return [envelope(f"b-{i}", payload={"i": i}) for i in range(count)]


def test_batch_of_good_items_returns_their_acks_in_order(queue: TaskQueue) -> None:
    items = batch(4)
    acks = queue.receive_batch(A, items)
    assert [a.task_id for a in acks] == [expected_task_id("agent-a", e.message_id) for e in items]
    assert [(a.ack, a.duplicate) for a in acks] == [("stored", False)] * 4
    for ack, item in zip(acks, items, strict=True):
        task = queue.task(ack.task_id)
        assert task is not None
        assert (task["state"], task["payload"]) == ("pending", item.payload)


def test_empty_batch_returns_no_acks(queue: TaskQueue) -> None:
    assert queue.receive_batch(A, []) == []
    assert_nothing_written(queue)


def test_batch_failure_keeps_the_committed_prefix_only(queue: TaskQueue) -> None:
    items = batch(5)
    items[2] = envelope("b-2", payload={"i": 2}, kind="result")
    with pytest.raises(BatchFailed) as raised:
        queue.receive_batch(A, items)
    failure = raised.value
    assert failure.index == 2
    assert isinstance(failure.cause, InvalidEnvelope)
    assert [a.task_id for a in failure.committed] == [
        expected_task_id("agent-a", "b-0"),
        expected_task_id("agent-a", "b-1"),
    ]
    assert [a.duplicate for a in failure.committed] == [False, False]
    for ack in failure.committed:
        task = queue.task(ack.task_id)
        assert task is not None
        assert task["state"] == "pending"
    for later in ("b-2", "b-3", "b-4"):
        assert queue.task(expected_task_id("agent-a", later)) is None
    assert len(rows(queue, "outbox_inbox")) == 2

    # Replaying the same batch: the stored prefix comes back as duplicates.
    with pytest.raises(BatchFailed) as replayed:
        queue.receive_batch(A, items)
    assert replayed.value.index == 2
    assert [(a.task_id, a.duplicate) for a in replayed.value.committed] == [
        (a.task_id, True) for a in failure.committed
    ]

    # Fixing the bad item and replaying stores the rest.
    items[2] = envelope("b-2", payload={"i": 2})
    acks = queue.receive_batch(A, items)
    assert [a.duplicate for a in acks] == [True, True, False, False, False]
    assert len(rows(queue, "outbox_tasks")) == 5


def test_batch_stops_at_a_collision(queue: TaskQueue) -> None:
    queue.receive(A, envelope("b-1", payload={"i": "original"}))
    with pytest.raises(BatchFailed) as raised:
        queue.receive_batch(A, batch(3))
    assert raised.value.index == 1
    assert isinstance(raised.value.cause, PayloadCollision)
    assert [(a.task_id, a.duplicate) for a in raised.value.committed] == [
        (expected_task_id("agent-a", "b-0"), False)
    ]
    assert queue.task(expected_task_id("agent-a", "b-2")) is None
    task = queue.task(expected_task_id("agent-a", "b-1"))
    assert task is not None
    assert task["payload"] == {"i": "original"}


def test_replayed_good_batch_is_all_duplicates(queue: TaskQueue) -> None:
    first = queue.receive_batch(A, batch(3))
    second = queue.receive_batch(A, batch(3))
    assert [(a.task_id, a.duplicate) for a in second] == [(a.task_id, True) for a in first]
    assert len(rows(queue, "outbox_tasks")) == 3


# --- in the caller's transaction (receive_tx) -------------------------------------


@contextmanager
def caller_transaction(
    queue: TaskQueue, flavour: str, commit: bool = True
) -> Iterator[Session | Connection]:
    """A transaction the test owns, on a Session or a Connection; an exception rolls it back."""
    tx: Session | Connection
    with Session(queue.engine) if flavour == "session" else queue.engine.connect() as tx:
        yield tx
        if commit:
            tx.commit()
        else:
            tx.rollback()


FLAVOURS = pytest.mark.parametrize("flavour", ["session", "connection"])


@FLAVOURS
def test_receive_tx_stores_what_receive_would_when_the_caller_commits(
    queue: TaskQueue, flavour: str
) -> None:
    with caller_transaction(queue, flavour) as tx:
        ack = queue.receive_tx(tx, A, envelope())
        outbox.publish(tx, "billing", "order-1:created", {"order": 1})  # the caller's own write
        again = queue.receive_tx(tx, A, envelope())
    assert (ack.task_id, ack.duplicate, ack.ack) == (
        expected_task_id("agent-a", "m-1"),
        False,
        "stored",
    )
    assert (again.task_id, again.duplicate) == (ack.task_id, True)
    task = queue.task(ack.task_id)
    assert task is not None
    assert (task["state"], task["payload"], task["deadline"]) == ("pending", {"n": 1}, DEADLINE)
    # receive() sees the same identity and content: a duplicate, nothing new.
    before = snapshot(queue)
    assert queue.receive(A, envelope()) == again
    assert snapshot(queue) == before
    assert [m["reply_id"] for m in queue.messages()] == ["order-1:created"]


@FLAVOURS
@pytest.mark.parametrize("deadline", [DEADLINE, START - 1], ids=["pending", "expired-at-intake"])
def test_receive_tx_rolled_back_with_the_caller_stores_nothing(
    queue: TaskQueue, flavour: str, deadline: float
) -> None:
    with caller_transaction(queue, flavour, commit=False) as tx:
        ack = queue.receive_tx(tx, A, envelope(deadline=deadline))
        assert queue.receive_tx(tx, A, envelope(deadline=deadline)).duplicate
    assert_nothing_written(queue)  # the task, its inbox row and an expired task's reply
    # Nothing of it lingers: the same envelope is new again.
    assert queue.receive(A, envelope(deadline=deadline)) == ack


@FLAVOURS
def test_receive_tx_collision_leaves_the_callers_transaction_usable(
    queue: TaskQueue, flavour: str
) -> None:
    stored = queue.receive(A, envelope())
    before = snapshot(queue)
    with caller_transaction(queue, flavour) as tx:
        assert queue.receive_tx(tx, A, envelope()) == Ack(stored.task_id, duplicate=True)
        with pytest.raises(PayloadCollision):
            queue.receive_tx(tx, A, envelope(payload={"n": 2}))
        outbox.publish(tx, "billing", "after-the-collision", {"n": 2})
    assert snapshot(queue)[:2] == before[:2]
    assert [m["reply_id"] for m in queue.messages()] == ["after-the-collision"]


@pytest.mark.parametrize("fields", INVALID)
def test_receive_tx_refuses_an_invalid_envelope_before_writing(
    queue: TaskQueue, fields: dict[str, Any]
) -> None:
    with caller_transaction(queue, "session") as tx, pytest.raises(InvalidEnvelope):
        queue.receive_tx(tx, A, envelope(**fields))
    assert_nothing_written(queue)


@pytest.mark.parametrize(("auth", "sender"), UNAUTHORIZED[:5])
def test_receive_tx_refuses_an_unauthorized_caller(
    queue: TaskQueue, auth: Any, sender: Any
) -> None:
    with caller_transaction(queue, "connection") as tx, pytest.raises(Unauthorized):
        queue.receive_tx(tx, auth, envelope(sender=sender))
    assert_nothing_written(queue)
