"""Batch mode with chained keys: items carry their ordering key, a batch carries several
of one key only for `ordered_batches`, and `held` and `retry` items wait their turn."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from starlette.requests import Request
from starlette.responses import Response
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Received, ScriptedServer

from outbox.errors import ConfigError
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.config import destinations_from
from relay.records import Message
from relay.transports.http import HELD_BY_RECEIVER, pack_batches

Decide = Callable[[list[dict[str, str]]], list[dict[str, str]]]


def all_stored(items: list[dict[str, str]]) -> list[dict[str, str]]:
    """The answer of a receiver that stores every item."""
    return [{"reply_id": item["reply_id"], "status": "stored"} for item in items]


class BatchStub(ScriptedServer):
    """A batch endpoint whose per-item answer a test decides, recording each batch's items."""

    def __init__(self, decide: Decide = all_stored) -> None:
        super().__init__()
        self.decide = decide
        self.batches: list[list[dict[str, str]]] = []

    async def _post(self, request: Request) -> Response:
        body = await request.body()
        items = json.loads(body)["replies"]
        with self._lock:
            self.received.append(Received(request.url.path, "", body, dict(request.headers)))
            self.batches.append(items)
        return Response(json.dumps({"results": self.decide(items)}), 200)

    def item_ids(self) -> list[list[str]]:
        """Each batch's reply_ids, in the order the batches arrived."""
        with self._lock:
            return [[item["reply_id"] for item in batch] for batch in self.batches]


def relay_for(db_url: str, stub: BatchStub, clock: ManualClock, **options: object) -> Relay:
    destination = make_destination(
        stub.url,
        secret=SECRET,
        timeout=5,
        mode="batch",
        batch_url=stub.url,
        **options,  # type: ignore[arg-type]
    )
    return Relay(db_url, {"default": destination}, owner="relay-1", clock=clock)


def test_a_batch_item_carries_its_ordering_key_when_it_has_one() -> None:
    keyed = Message(1, "k-1", "default", b"{}", "", {}, 1, 1, "order.7")
    unkeyed = Message(2, "free-1", "default", b"{}", "", {}, 1, 1)
    [(_, body)] = pack_batches([keyed, unkeyed], 10, 10_000)
    items = json.loads(body)["replies"]
    assert items[0]["ordering_key"] == "order.7"
    assert "ordering_key" not in items[1]


def test_without_ordered_batches_a_batch_holds_one_message_of_a_key(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["k-1", "k-2", "k-3"], ordering_key="K", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)
    with BatchStub() as stub, relay_for(db_url, stub, clock) as relay:
        verdicts = dict(relay.dispatch_once())
        batches = stub.item_ids()
    assert verdicts == dict.fromkeys(["k-1", "k-2", "k-3", "free-1"], "sent")
    # One turn; the key's next message goes in a later batch, once the earlier one
    # was answered.
    assert batches == [["k-1", "free-1"], ["k-2"], ["k-3"]]


def test_without_ordered_batches_a_key_stops_at_an_item_to_retry(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["k-1", "k-2", "k-3"], ordering_key="K", clock=clock)

    def retry_k1(items: list[dict[str, str]]) -> list[dict[str, str]]:
        return [
            {"reply_id": i["reply_id"], "status": "retry" if i["reply_id"] == "k-1" else "stored"}
            for i in items
        ]

    with BatchStub(retry_k1) as stub, relay_for(db_url, stub, clock) as relay:
        verdicts = dict(relay.dispatch_once())
        batches = stub.item_ids()
    assert verdicts == dict.fromkeys(["k-1", "k-2", "k-3"], "retry")
    assert batches == [["k-1"]]  # k-2 and k-3 never went
    stored = rows(engine)
    assert [stored[r]["attempts"] for r in ("k-1", "k-2", "k-3")] == [1, 0, 0]


def test_ordered_batches_carry_a_key_in_order_and_settle_held_and_retry_items(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["k-1", "k-2", "k-3", "k-4"], ordering_key="K", clock=clock)
    publish_many(engine, ["j-1", "j-2"], ordering_key="J", clock=clock)
    answers = {
        "k-1": {"status": "stored"},
        "k-2": {"status": "retry", "error": "account locked"},
        "k-3": {"status": "held"},
        "k-4": {"status": "held"},
        # A receiver that broke the rule: j-2 was applied after j-1 was not. It is sent
        # (resending it would not undo it); j-1 retries.
        "j-1": {"status": "retry"},
        "j-2": {"status": "stored"},
    }

    def decide(items: list[dict[str, str]]) -> list[dict[str, str]]:
        return [{"reply_id": i["reply_id"], **answers[i["reply_id"]]} for i in items]

    with BatchStub(decide) as stub, relay_for(db_url, stub, clock, ordered_batches=True) as relay:
        verdicts = dict(relay.dispatch_once())
        [batch] = stub.batches
    assert [(i["reply_id"], i["ordering_key"]) for i in batch] == [
        ("k-1", "K"),
        ("k-2", "K"),
        ("k-3", "K"),
        ("k-4", "K"),
        ("j-1", "J"),
        ("j-2", "J"),
    ]
    assert verdicts == {
        "k-1": "sent",
        "k-2": "retry",
        "k-3": "retry",
        "k-4": "retry",
        "j-1": "retry",
        "j-2": "sent",
    }
    stored = rows(engine)
    assert stored["k-2"]["attempts"] == 1
    assert stored["k-2"]["available_at"] > clock()
    assert "account locked" in stored["k-2"]["last_error"]
    for held in ("k-3", "k-4"):
        row = stored[held]
        assert (row["state"], row["attempts"], row["available_at"]) == ("pending", 0, clock())
        assert row["last_error"] == HELD_BY_RECEIVER.error


def test_an_ordered_chain_split_across_batches_stops_where_its_key_stopped(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["k-1", "k-2", "k-3"], ordering_key="K", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)

    def hold_k2(items: list[dict[str, str]]) -> list[dict[str, str]]:
        return [
            {"reply_id": i["reply_id"], "status": "held" if i["reply_id"] == "k-2" else "stored"}
            for i in items
        ]

    with (
        BatchStub(hold_k2) as stub,
        relay_for(db_url, stub, clock, ordered_batches=True, max_batch_items=2) as relay,
    ):
        verdicts = dict(relay.dispatch_once())
        batches = stub.item_ids()
    # k-3 was in the second batch, which waited for the first; held back, it never went.
    assert batches == [["k-1", "k-2"], ["free-1"]]
    assert verdicts == {"k-1": "sent", "k-2": "retry", "k-3": "retry", "free-1": "sent"}
    assert rows(engine)["k-3"]["attempts"] == 0


def test_ordered_batches_is_read_from_the_file_and_the_environment() -> None:
    env = {
        "OUTBOX_DESTINATION_BILLING_URL": "https://billing.example/hooks",
        "OUTBOX_DESTINATION_BILLING_SECRET": SECRET,
        "OUTBOX_DESTINATION_BILLING_MODE": "batch",
        "OUTBOX_DESTINATION_BILLING_ORDERED_BATCHES": "true",
    }
    assert destinations_from({}, None, env)["billing"].options.ordered_batches is True
    document = {
        "destinations": {
            "orders": {
                "url": "https://orders.example/hooks",
                "mode": "batch",
                "ordered_batches": True,
                "unsigned": True,
            }
        }
    }
    assert destinations_from(document, "relay.toml", {})["orders"].options.ordered_batches is True
    assert make_destination("https://x.example/", secret=SECRET).options.ordered_batches is False
    with pytest.raises(ConfigError, match="ordered_batches: expected true or false"):
        destinations_from(
            {"destinations": {"o": {**document["destinations"]["orders"], "ordered_batches": 1}}},
            "relay.toml",
            {},
        )
    with pytest.raises(ConfigError, match="ordered_batches is a key of http destinations"):
        make_destination(
            "nats://127.0.0.1:4222",
            secret=SECRET,
            kind="nats",
            stream="S",
            subject="s",
            ordered_batches=True,
        )


def test_held_with_nothing_to_wait_for_is_a_counted_retry(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    # A receiver answering `held` where no earlier item of the key failed (the first of
    # its key, after a stored one, or with no key) must not keep a message pending for
    # ever: only a hold behind its key gives the attempt back.
    publish_many(engine, ["k-1", "k-2"], ordering_key="K", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)

    def hold_all(items: list[dict[str, str]]) -> list[dict[str, str]]:
        return [{"reply_id": i["reply_id"], "status": "held"} for i in items]

    with BatchStub(hold_all) as stub, relay_for(db_url, stub, clock, ordered_batches=True) as relay:
        verdicts = dict(relay.dispatch_once())
    assert verdicts == {"k-1": "retry", "k-2": "retry", "free-1": "retry"}
    stored = rows(engine)
    # k-1 and free-1 spent an attempt and wait their backoff; k-2, behind k-1, did not.
    assert [stored[r]["attempts"] for r in ("k-1", "free-1", "k-2")] == [1, 1, 0]
    assert stored["k-1"]["available_at"] > clock()
    assert stored["k-2"]["last_error"] == HELD_BY_RECEIVER.error
