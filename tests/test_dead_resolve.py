"""`outbox dead resolve`: a dead message settled as needing no delivery, final and audited."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from support.cli_helpers import one_line_error
from support.operations_helpers import (
    audit_rows,
    dead_messages,
    mark_dead,
    mark_sent,
    run_json,
)
from support.relay_helpers import publish_many, rows

import outbox
from outbox.errors import RequeueRefused, ResolveRefused
from outbox.operations import Operations
from outbox.schema import messages
from outbox.testing import ManualClock
from outbox_cli import main

TIMEOUT = 60.0


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


def states(engine: sa.Engine) -> dict[str, str]:
    """Every message's state by reply_id."""
    return {reply_id: row["state"] for reply_id, row in rows(engine).items()}


def test_resolve_settles_a_dead_message_for_good_and_keeps_an_audit(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["lost-1", "other"], clock=clock)
    mark_dead(engine, "lost-1")
    before = rows(engine)["lost-1"]
    clock.advance(90)
    with Operations(db_url, clock=clock) as ops:
        audit = ops.resolve("lost-1", reason="billing confirmed it by phone", by="ops-anna")
        assert ops.dead() == []  # dead list shows dead messages only
        status = ops.status()
    assert (audit["action"], audit["reply_id"], audit["requested_by"]) == (
        "resolve",
        "lost-1",
        "ops-anna",
    )
    assert audit["reason"] == "billing confirmed it by phone"
    assert (audit["receipt"], audit["forced"]) == ("not checked", False)  # nothing was asked
    assert (audit["previous_attempts"], audit["previous_status"]) == (3, 503)
    assert (audit["previous_error"], audit["requested_at"]) == ("HTTP 503", clock())
    assert audit_rows(engine) == [audit]
    after = rows(engine)["lost-1"]
    assert (after["state"], after["resolved_at"], after["sent_at"]) == ("resolved", clock(), None)
    # Why it died stays on the row; nothing about the message itself changed.
    for column in ("id", "body", "content_hash", "attempts", "last_status", "last_error"):
        assert after[column] == before[column], column
    assert status["messages"] == {
        "pending": 1,
        "sending": 0,
        "sent": 0,
        "dead": 0,
        "resolved": 1,
    }
    assert status["dead"] == 0


def seed_every_state(engine: sa.Engine, clock: ManualClock, db_url: str) -> None:
    """One message in each state but dead: pending, sending, sent and resolved."""
    publish_many(engine, ["is-pending", "is-sending", "is-sent", "is-resolved"], clock=clock)
    mark_sent(engine, {"is-sent": clock()})
    with engine.begin() as conn:
        conn.execute(
            messages.update().where(messages.c.reply_id == "is-sending").values(state="sending")
        )
    mark_dead(engine, "is-resolved")
    with Operations(db_url, clock=clock) as ops:
        ops.resolve("is-resolved", reason="seen", by="ops")


@pytest.mark.parametrize(
    ("reply_id", "complaint"),
    [
        ("is-pending", "message 'is-pending' is pending, not dead; nothing resolved"),
        ("is-sending", "message 'is-sending' is sending, not dead; nothing resolved"),
        ("is-sent", "message 'is-sent' is sent, not dead; nothing resolved"),
        ("is-resolved", "message 'is-resolved' is resolved, which is final; nothing resolved"),
        ("no-such", "no message 'no-such'; nothing resolved"),
    ],
)
def test_resolve_refuses_a_message_that_is_not_dead(
    reply_id: str, complaint: str, db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    seed_every_state(engine, clock, db_url)
    before, audit_before = rows(engine), audit_rows(engine)
    with Operations(db_url, clock=clock) as ops, pytest.raises(ResolveRefused) as refused:
        ops.resolve(reply_id, reason="r", by="ops")
    assert str(refused.value) == complaint
    assert rows(engine) == before
    assert audit_rows(engine) == audit_before


def test_a_resolved_message_is_never_requeued(
    db_url: str, engine: sa.Engine, clock: ManualClock, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_every_state(engine, clock, db_url)
    with Operations(db_url, clock=clock) as ops, pytest.raises(RequeueRefused) as refused:
        ops.requeue("is-resolved", reason="r", by="ops", receipt="not received", forced=True)
    assert str(refused.value) == (
        "message 'is-resolved' is resolved, which is final; nothing requeued"
    )
    for command in ("requeue", "resolve"):
        argv = ["dead", command, "is-resolved", "--reason", "again", "--db", db_url]
        assert main([*argv, *(["--force"] if command == "requeue" else [])]) == 1
        err = capsys.readouterr().err
        assert "message is resolved, which is final (it needs no delivery): 'is-resolved'" in err
    assert states(engine)["is-resolved"] == "resolved"
    assert [row["action"] for row in audit_rows(engine)] == ["resolve"]


def race(calls: list[Callable[[], str]]) -> list[str]:
    """Run the calls in threads released together by a barrier; their results."""
    barrier = threading.Barrier(len(calls), timeout=TIMEOUT)

    def released(call: Callable[[], str]) -> str:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(released, call) for call in calls]
        return [future.result(timeout=TIMEOUT) for future in futures]


def test_a_resolve_racing_a_requeue_lets_exactly_one_decide(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    ids = [f"race-{n}" for n in range(20)]
    publish_many(engine, ids, clock=clock)
    for reply_id in ids:
        mark_dead(engine, reply_id)
    # Each side has its own engine and connections, as two operators would.
    with Operations(db_url, clock=clock) as one, Operations(db_url, clock=clock) as other:
        for reply_id in ids:

            def resolve(reply_id: str = reply_id) -> str:
                try:
                    one.resolve(reply_id, reason="confirmed", by="ops-anna")
                except ResolveRefused:
                    return "refused"
                return "resolved"

            def requeue(reply_id: str = reply_id) -> str:
                try:
                    other.requeue(
                        reply_id, reason="send", by="ops-ben", receipt="not received", forced=False
                    )
                except RequeueRefused:
                    return "refused"
                return "pending"

            outcomes = race([resolve, requeue])
            assert sorted(outcomes).count("refused") == 1, (reply_id, outcomes)
            [winner] = [outcome for outcome in outcomes if outcome != "refused"]
            assert states(engine)[reply_id] == winner
    audit = audit_rows(engine)
    assert sorted(str(row["reply_id"]) for row in audit) == sorted(ids)  # one decision each
    for row in audit:
        expected = "resolved" if row["action"] == "resolve" else "pending"
        assert states(engine)[str(row["reply_id"])] == expected


def test_resolve_command_for_one_reply_id(
    db_url: str, engine: sa.Engine, clock: ManualClock, capsys: pytest.CaptureFixture[str]
) -> None:
    dead_messages(engine, clock)
    audit = run_json(
        capsys,
        *("dead", "resolve", "b-1", "--reason", "billing has it", "--by", "ops-anna"),
        *("--db", db_url),
    )
    assert isinstance(audit, dict)
    assert (audit["reply_id"], audit["action"], audit["requested_by"]) == (
        "b-1",
        "resolve",
        "ops-anna",
    )
    argv = ["dead", "resolve", "b-2", "--reason", "billing has it", "--db", db_url]
    assert main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out == "would resolve 'b-2'\n"
    assert states(engine)["b-2"] == "dead"
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == "resolved 'b-2': it will not be delivered (audit #2)\n"
    assert captured.err == ""  # no receipt lookup to warn about: nothing is asked
    assert [row["requested_by"] for row in audit_rows(engine)][:1] == ["ops-anna"]
    listed = run_json(capsys, "dead", "list", "--db", db_url)
    assert [row["reply_id"] for row in listed] == ["s-1", "s-2"]  # type: ignore[union-attr]
    status = run_json(capsys, "status", "--db", db_url)
    assert status["messages"]["resolved"] == 2  # type: ignore[index]
    assert main(["status", "--db", db_url]) == 0
    assert "dead 2  resolved 2" in capsys.readouterr().out


def test_bulk_resolve_by_filter_with_a_dry_run_first(
    db_url: str, engine: sa.Engine, clock: ManualClock, capsys: pytest.CaptureFixture[str]
) -> None:
    dead_messages(engine, clock)  # created at 0, 1, 2 and 3 hours; now is 4 hours
    argv = ["dead", "resolve", "--db", db_url, "--status", "410", "--reason", "gone for good"]
    assert main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out == (
        "would resolve b-1\nwould resolve s-1\nwould resolve 2, refused 0\n"
    )
    assert set(states(engine).values()) == {"dead"}  # a dry run changes nothing
    assert audit_rows(engine) == []
    assert main([*argv, "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert [(r["reply_id"], r["outcome"], r["audit"]["action"]) for r in done] == [
        ("b-1", "resolved", "resolve"),
        ("s-1", "resolved", "resolve"),
    ]
    assert states(engine) == {"b-1": "resolved", "b-2": "dead", "s-1": "resolved", "s-2": "dead"}
    # Chosen again, only what is still dead: b-1 is resolved already.
    argv = ["dead", "resolve", "--db", db_url, "--destination", "billing", "--reason", "old"]
    assert main(argv) == 0
    assert capsys.readouterr().out == "resolved      b-2\nresolved 1, refused 0\n"
    assert sorted(str(row["reply_id"]) for row in audit_rows(engine)) == ["b-1", "b-2", "s-1"]


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["dead", "resolve", "x"], "the following arguments are required: --reason"),
        (["dead", "resolve", "x", "--reason", " "], "argument --reason: must not be empty"),
        (["dead", "resolve", "--since", "2x", "--reason", "r"], "invalid duration '2x'"),
    ],
)
def test_bad_resolve_arguments_are_a_one_line_error_and_exit_2(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert complaint in one_line_error(argv, capsys)


def test_resolve_needs_one_reply_id_or_filters(
    db_url: str, engine: sa.Engine, clock: ManualClock, capsys: pytest.CaptureFixture[str]
) -> None:
    dead_messages(engine, clock)
    base = ["dead", "resolve", "--db", db_url, "--reason", "r"]
    assert main(base) == 2
    assert "resolve needs a REPLY_ID or at least one filter" in capsys.readouterr().err
    assert main([*base, "b-1", "--destination", "billing"]) == 2
    assert "not both" in capsys.readouterr().err
    assert set(states(engine).values()) == {"dead"}
    assert audit_rows(engine) == []


NO_LOGIN_NAME = [
    OSError("No username set in the environment"),
    KeyError("getpwuid(): uid not found: 10001"),
]
"""What getpass.getuser raises for a container's uid with no passwd entry, LOGNAME or USER."""


@pytest.mark.parametrize("failure", NO_LOGIN_NAME, ids=["oserror", "keyerror"])
def test_with_no_login_name_a_dry_run_works_and_a_decision_asks_for_by(
    failure: Exception,
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead_messages(engine, clock)

    def no_login_name() -> str:
        raise failure

    monkeypatch.setattr("getpass.getuser", no_login_name)
    argv = ["dead", "resolve", "b-2", "--reason", "billing has it", "--db", db_url]
    assert main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out == "would resolve 'b-2'\n"
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "outbox: error: no login name to keep in the audit: give --by NAME\n"
    )
    assert states(engine)["b-2"] == "dead"
    assert main([*argv, "--by", "ops-anna"]) == 0
    assert [row["requested_by"] for row in audit_rows(engine)] == ["ops-anna"]


def test_decisions_made_together_commit_together_or_not_at_all(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["d-1", "d-2", "d-3"], clock=clock)
    for reply_id in ("d-1", "d-2", "d-3"):
        mark_dead(engine, reply_id)
    with Operations(db_url, clock=clock) as ops:

        def fail_after_two_decisions() -> None:
            with ops.together() as shared:
                shared.resolve("d-1", reason="dup", by="ops-anna")
                shared.requeue(
                    "d-2", reason="back", by="ops-anna", receipt="not received", forced=False
                )
                raise RuntimeError("the batch fails after two decisions")

        with pytest.raises(RuntimeError):
            fail_after_two_decisions()
        assert set(states(engine).values()) == {"dead"}
        assert audit_rows(engine) == []
        with ops.together() as shared:
            shared.resolve("d-1", reason="dup", by="ops-anna")
            # A refusal inside the batch refuses that message alone.
            with pytest.raises(ResolveRefused):
                shared.resolve("nothing", reason="dup", by="ops-anna")
            shared.requeue(
                "d-2", reason="back", by="ops-anna", receipt="not received", forced=False
            )
        # The shared handle was a view: the engine it came from still serves.
        assert [row["reply_id"] for row in ops.dead()] == ["d-3"]
    assert states(engine) == {"d-1": "resolved", "d-2": "pending", "d-3": "dead"}
    assert [row["reply_id"] for row in audit_rows(engine)] == ["d-1", "d-2"]
