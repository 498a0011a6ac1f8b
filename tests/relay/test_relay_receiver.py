"""The relay against the reference receiver running as a real process (both modes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.processes import PROCESS_EXIT
from support.receiver_helpers import SECRET, ReceiverProcess, count_effects, stored_receipts
from support.relay_helpers import publish_many, rows

from outbox import failpoints
from outbox.testing import ManualClock
from receiver import ReceiptStore
from receiver.effects import record_effect
from relay import Destination, Relay, make_destination


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """The receiver's secrets file."""
    path = tmp_path / "secrets"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return path


@pytest.fixture
def receiver_process(db_url: str, secret_file: Path) -> Iterator[ReceiverProcess]:
    """A healthy receiver process on the test database."""
    process = ReceiverProcess(db_url, secret_file).wait_ready()
    yield process
    process.stop()


def destination(process: ReceiverProcess, mode: str) -> Destination:
    """The receiver as a relay destination, with its receipt lookup."""
    return make_destination(
        process.base + "/replies",
        secret=SECRET,
        timeout=5,
        mode=mode,  # type: ignore[arg-type]
        receipt_lookup=True,
    )


def drain(relay: Relay) -> list[tuple[str, str]]:
    """Dispatch until a turn finds nothing; returns every verdict."""
    verdicts: list[tuple[str, str]] = []
    for _ in range(50):
        turn = relay.dispatch_once()
        if not turn:
            return verdicts
        verdicts.extend(turn)
    raise AssertionError("relay did not drain in 50 turns")


@pytest.mark.parametrize("mode", ["single", "batch"])
def test_every_reply_arrives_once_with_its_exact_bytes(
    mode: str,
    db_url: str,
    engine: sa.Engine,
    receiver_process: ReceiverProcess,
    clock: ManualClock,
) -> None:
    ids = [f"e-{n:02d}" for n in range(25)]
    publish_many(engine, ids, clock=clock)
    with Relay(
        db_url, {"default": destination(receiver_process, mode)}, clock=clock, batch=10
    ) as relay:
        verdicts = drain(relay)
    assert sorted(verdicts) == [(i, "sent") for i in ids]
    stored = rows(engine)
    assert stored_receipts(db_url) == {i: stored[i]["body"] for i in ids}
    assert all(count_effects(db_url, i) == 1 for i in ids)


@pytest.mark.parametrize("mode", ["single", "batch"])
def test_same_id_other_body_is_dead_as_a_conflict(
    mode: str,
    db_url: str,
    engine: sa.Engine,
    receiver_process: ReceiverProcess,
    clock: ManualClock,
) -> None:
    with ReceiptStore(db_url) as store:
        store.accept("c-1", b'{"someone":"else"}', record_effect)
    publish_many(engine, ["c-1", "c-2"], clock=clock)
    with Relay(db_url, {"default": destination(receiver_process, mode)}, clock=clock) as relay:
        assert sorted(drain(relay)) == [("c-1", "dead"), ("c-2", "sent")]
    row = rows(engine)["c-1"]
    assert (row["state"], row["last_status"]) == ("dead", 409)
    assert "conflict" in row["last_error"]
    assert stored_receipts(db_url)["c-1"] == b'{"someone":"else"}'
    assert count_effects(db_url, "c-1") == 1


@pytest.mark.parametrize("reply_id", ["k-1", "k/1?x#y%2F"])
def test_receipt_lookup_settles_an_unknown_outcome_as_sent(
    reply_id: str,
    db_url: str,
    engine: sa.Engine,
    receiver_process: ReceiverProcess,
    clock: ManualClock,
) -> None:
    publish_many(engine, [reply_id], clock=clock)
    with ReceiptStore(db_url) as store:  # the remote committed; its ACK never came back
        store.accept(reply_id, rows(engine)[reply_id]["body"], record_effect)
    target = {"default": destination(receiver_process, "single")}
    with (
        Relay(db_url, target, clock=clock, owner="relay-a", max_attempts=1, lease=6) as crashed,
        Relay(db_url, target, clock=clock, owner="relay-b", max_attempts=1, lease=6) as survivor,
    ):
        assert len(crashed.leases.claim()[0]) == 1  # claimed, then died mid-send
        clock.advance(7)
        assert survivor.dispatch_once() == [(reply_id, "sent")]
    assert rows(engine)[reply_id]["state"] == "sent"
    assert count_effects(db_url, reply_id) == 1


def test_lost_ack_is_resent_and_answered_as_duplicate(
    db_url: str, engine: sa.Engine, secret_file: Path, clock: ManualClock
) -> None:
    publish_many(engine, ["l-1"], clock=clock)
    crashing = ReceiverProcess(
        db_url, secret_file, failpoints.environment("receiver.after_commit")
    ).wait_ready()
    try:
        with Relay(
            db_url, {"default": destination(crashing, "single")}, clock=clock, backoff=1
        ) as relay:
            assert relay.dispatch_once() == [("l-1", "retry")]
        assert crashing.proc.wait(timeout=PROCESS_EXIT) == failpoints.EXIT_CODE
    finally:
        crashing.stop()
    assert count_effects(db_url, "l-1") == 1  # committed before the ACK was lost
    healthy = ReceiverProcess(db_url, secret_file).wait_ready()
    try:
        clock.advance(1)
        with Relay(db_url, {"default": destination(healthy, "single")}, clock=clock) as relay:
            assert relay.dispatch_once() == [("l-1", "sent")]
    finally:
        healthy.stop()
    assert rows(engine)["l-1"]["attempts"] == 2
    assert count_effects(db_url, "l-1") == 1
