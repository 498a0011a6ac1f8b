"""`outbox status`, `outbox dead list|show|requeue` and `outbox purge` against seeded states."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.cli_helpers import one_line_error
from support.operations_helpers import (
    audit_rows,
    dead_messages,
    mark_dead,
    mark_resolved,
    mark_sent,
    run_json,
    state_rows,
)
from support.receiver_helpers import SECRET, relay_toml
from support.relay_helpers import publish_many, rows
from support.served import served_receiver

import outbox
from outbox import AuthContext, Envelope, TaskQueue
from outbox.dead_filter import DeadFilter
from outbox.operations import Operations
from outbox.schema import messages, tasks
from outbox.testing import ManualClock
from outbox_cli import main
from receiver import ReceiptStore
from relay import Relay, make_destination

SOURCE = AuthContext("agent-a")
DAY = 86400.0
# Nothing listens on the discard port: deliveries there fail fast and are retried.
NOWHERE = "http://127.0.0.1:9/replies"


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


@pytest.fixture
def seeded(db_url: str, engine: sa.Engine, clock: ManualClock) -> str:
    """Tasks pending, running and done; messages pending (one retried) and dead."""
    with TaskQueue(db_url, clock=clock, allowed_sources=("agent-a",)) as queue:
        for n in range(4):
            queue.receive(SOURCE, Envelope(f"m-{n}", "agent-a", {"n": n}, clock() + 3600))
        done = queue.claim("worker-1")
        assert done is not None
        queue.finish(done, {"ok": True})  # commits the task's reply with it
        assert queue.claim("worker-1") is not None  # and this one stays running
    with Session(engine) as session, session.begin():
        outbox.publish(session, "nowhere", "to-nowhere", {"n": 1}, clock=clock)
    # The task's reply fails to connect and waits for a retry; the message for "nowhere"
    # was refused for good by a destination (410) and is dead.
    with Relay(
        db_url, {"default": make_destination(NOWHERE, timeout=2, unsigned=True)}, clock=clock
    ) as relay:
        assert relay.dispatch_once() == [(f"reply:{done.task_id}", "retry")]
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.reply_id == "to-nowhere")
            .values(state="dead", attempts=1, last_status=410, last_error="HTTP 410: gone")
        )
    clock.advance(30)
    return db_url


def state_counts(engine: sa.Engine, table: sa.Table) -> dict[str, int]:
    """Rows per state, straight from the database."""
    with engine.connect() as conn:
        query = sa.select(table.c.state, sa.func.count()).group_by(table.c.state)
        return {state: int(count) for state, count in conn.execute(query)}


def test_status_counts_every_state_as_the_database_holds_them(
    seeded: str, engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    status = run_json(capsys, "status", "--db", seeded)
    assert isinstance(status, dict)
    assert {k: v for k, v in status["tasks"].items() if v} == state_counts(engine, tasks)
    assert {k: v for k, v in status["messages"].items() if v} == state_counts(engine, messages)
    assert status["tasks"] == {
        "pending": 2,
        "running": 1,
        "done": 1,
        "failed": 0,
        "cancelled": 0,
        "expired": 0,
        "hop_limit": 0,
    }
    assert status["messages"] == {
        "pending": 1,
        "sending": 0,
        "sent": 0,
        "dead": 1,
        "resolved": 0,
    }
    assert status["dead"] == 1
    assert status["unrouted"] == 1  # the relay stopped: nothing delivers its pending reply
    assert main(["status", "--db", seeded]) == 0
    text = capsys.readouterr().out
    assert "messages pending 1  sending 0  sent 0  dead 1" in text
    assert "1 unrouted (oldest" in text
    assert "1 dead: see `outbox dead list`" in text


def test_status_ages_run_on_the_database_clock(seeded: str, clock: ManualClock) -> None:
    # Tasks arrived at START, the published message and retried reply right after;
    # the seed then moved the clock 30 s on.
    with Operations(seeded, clock=clock) as ops:
        status = ops.status()
        assert status["oldest_pending_task_age"] == 30.0
        assert status["oldest_pending_message_age"] == 30.0
        clock.advance(12.5)
        assert ops.status()["oldest_pending_task_age"] == 42.5


def test_dead_list_and_show_explain_why(seeded: str, capsys: pytest.CaptureFixture[str]) -> None:
    [dead] = run_json(capsys, "dead", "list", "--db", seeded)  # type: ignore[misc]
    assert dead["reply_id"] == "to-nowhere"
    assert dead["destination"] == "nowhere"
    assert dead["last_error"] == "HTTP 410: gone"
    shown = run_json(capsys, "dead", "show", "to-nowhere", "--db", seeded)
    assert isinstance(shown, dict)
    assert shown["state"] == "dead"
    assert shown["last_error"] == dead["last_error"]
    assert shown["body_bytes"] == len(b'{"n":1}')
    assert main(["dead", "list", "--db", seeded]) == 0
    assert "to-nowhere" in capsys.readouterr().out


def test_dead_show_of_a_missing_or_live_reply_is_a_one_line_error(
    seeded: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dead", "show", "no-such-reply", "--db", seeded]) == 1
    assert capsys.readouterr().err == "outbox: no message 'no-such-reply'\n"
    [waiting] = [r for r in state_rows(seeded) if r["state"] == "pending"]
    assert main(["dead", "show", waiting["reply_id"], "--db", seeded]) == 1
    err = capsys.readouterr().err
    assert "message is pending, not dead" in err
    assert err.count("\n") == 1


def test_purge_deletes_sent_and_resolved_messages_past_the_age_in_batches(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    ids = [f"p-{n}" for n in range(9)]
    for reply_id in ids:
        with Session(engine) as session, session.begin():
            outbox.publish(session, "default", reply_id, {"id": reply_id}, clock=clock)
    clock.advance(3 * DAY)
    now = clock()
    # Sent: three long ago and one recently. Resolved: two long ago and one recently,
    # though created as long ago as the rest. One still dead, one never sent.
    mark_sent(engine, {"p-0": now - 3 * DAY, "p-1": now - 2 * DAY, "p-2": now - 2 * DAY})
    mark_sent(engine, {"p-3": now - 60})
    mark_resolved(engine, {"p-4": now - 2 * DAY, "p-5": now - 2 * DAY, "p-6": now - 60})
    mark_dead(engine, "p-7")
    seen: list[int] = []
    with Operations(db_url, clock=clock) as ops:
        assert ops.purge(DAY, batch=2, progress=seen.append) == {"sent": 3, "resolved": 2}
    assert seen == [2, 4, 5]
    assert sorted(r["reply_id"] for r in state_rows(db_url)) == ["p-3", "p-6", "p-7", "p-8"]


@pytest.mark.parametrize("flag", ["--older-than", "--sent-older-than"])
def test_purge_command_uses_the_database_clock(
    flag: str,
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for reply_id in ("old", "new", "old-resolved", "new-resolved"):
        with Session(engine) as session, session.begin():
            outbox.publish(session, "default", reply_id, {"id": reply_id}, clock=clock)
    mark_sent(engine, {"old": time.time() - 8 * DAY, "new": time.time()})
    mark_resolved(engine, {"old-resolved": time.time() - 8 * DAY, "new-resolved": time.time()})
    # --sent-older-than is the flag's name from before resolved messages: the same purge.
    result = run_json(capsys, "purge", flag, "7d", "--db", db_url)
    assert result == {
        "purged": 2,
        "by_state": {"sent": 1, "resolved": 1},
        "older_than_seconds": 7 * DAY,
    }
    assert sorted(r["reply_id"] for r in state_rows(db_url)) == ["new", "new-resolved"]
    assert main(["purge", flag, "7d", "--db", db_url]) == 0
    assert "purged 0 messages sent or resolved more than 7.0d ago (0 sent, 0 resolved)" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["purge", "--older-than", "7x"], "invalid duration '7x'"),
        (["purge", "--sent-older-than=-1d"], "invalid duration '-1d'"),
        (["purge"], "the following arguments are required: --older-than/--sent-older-than"),
        (["dead", "list", "--limit", "0"], "expected a whole number >= 1, got '0'"),
        (["dead", "frob"], "invalid choice: 'frob'"),
        (["status", "--verbose"], "unrecognized arguments: --verbose"),
        (["dead", "requeue", "x"], "the following arguments are required: --reason"),
        (["dead", "requeue", "x", "--reason", "  "], "argument --reason: must not be empty"),
    ],
)
def test_bad_arguments_are_a_one_line_error_and_exit_2(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert complaint in one_line_error(argv, capsys)


# --- requeue -------------------------------------------------------------------------


@pytest.fixture
def relay_config(tmp_path: Path, db_url: str) -> Iterator[Path]:
    """A relay TOML whose destination is the reference receiver, with its receipt lookup."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    with served_receiver(db_url) as served:
        yield relay_toml(tmp_path, "default", served.base, secret_file)


def test_requeue_sends_the_same_reply_again_and_keeps_an_audit(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    relay_config: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    publish_many(engine, ["lost-1"], clock=clock)
    before = rows(engine)["lost-1"]
    mark_dead(engine, "lost-1")
    audit = run_json(
        capsys,
        *("dead", "requeue", "lost-1", "--reason", "receiver was down", "--by", "ops-anna"),
        *("--config", str(relay_config), "--db", db_url),
    )
    assert isinstance(audit, dict)
    assert audit["receipt"] == "not received"
    assert audit["forced"] is False
    after = rows(engine)["lost-1"]
    assert (after["state"], after["attempts"], after["last_error"]) == ("pending", 0, None)
    # The same reply: id, body and hash untouched.
    assert (after["id"], after["body"], after["content_hash"]) == (
        before["id"],
        before["body"],
        before["content_hash"],
    )
    [kept] = audit_rows(engine)
    assert (kept["reply_id"], kept["action"]) == ("lost-1", "requeue")
    assert kept["requested_by"] == "ops-anna"
    assert kept["reason"] == "receiver was down"
    assert (kept["previous_attempts"], kept["previous_status"]) == (3, 503)
    assert kept["previous_error"] == "HTTP 503"
    # Requeued once: a second request finds nothing dead and changes nothing.
    assert main(["dead", "requeue", "lost-1", "--reason", "again", "--db", db_url]) == 1
    assert "not dead" in capsys.readouterr().err
    assert len(audit_rows(engine)) == 1


def test_requeue_finds_the_receipt_lookup_of_a_destination_from_the_environment(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with served_receiver(db_url) as served:
        monkeypatch.setenv("OUTBOX_DESTINATION_DEFAULT_URL", f"{served.base}/replies")
        monkeypatch.setenv("OUTBOX_DESTINATION_DEFAULT_SECRET", SECRET)
        monkeypatch.setenv("OUTBOX_DESTINATION_DEFAULT_RECEIPT_LOOKUP", "true")
        publish_many(engine, ["env-lost"], clock=clock)
        mark_dead(engine, "env-lost")
        audit = run_json(capsys, "dead", "requeue", "env-lost", "--reason", "down", "--db", db_url)
    assert isinstance(audit, dict)
    assert audit["receipt"] == "not received"  # asked, not "not checked"


@pytest.mark.parametrize(
    ("other_body", "complaint", "answer"),
    [
        # The receiver committed it; only the ACK was lost.
        (None, "already holds this exact message", "received"),
        (b'{"someone":"else"}', "holds this reply_id with another body", "other body"),
    ],
)
def test_requeue_refuses_what_the_destination_already_holds_unless_forced(
    other_body: bytes | None,
    complaint: str,
    answer: str,
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    relay_config: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    publish_many(engine, ["held"], clock=clock)
    mark_dead(engine, "held")
    with ReceiptStore(db_url) as store:
        store.accept("held", other_body or bytes(rows(engine)["held"]["body"]))
    argv = ["dead", "requeue", "held", "--reason", "check", "--config", str(relay_config)]
    assert main([*argv, "--db", db_url]) == 1
    assert complaint in capsys.readouterr().err
    assert rows(engine)["held"]["state"] == "dead"
    assert audit_rows(engine) == []
    audit = run_json(capsys, *argv, "--force", "--db", db_url)
    assert isinstance(audit, dict)
    assert (audit["receipt"], audit["forced"]) == (answer, True)
    assert rows(engine)["held"]["state"] == "pending"


@pytest.fixture
def no_relay_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """No config file names the destinations, whatever the environment running the tests."""
    for name in ("OUTBOX_CONFIG", "OUTBOX_RELAY_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_requeue_without_a_receipt_lookup_needs_force(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    capsys: pytest.CaptureFixture[str],
    no_relay_config: None,
) -> None:
    publish_many(engine, ["d-1"], clock=clock)
    mark_dead(engine, "d-1")
    argv = ["dead", "requeue", "d-1", "--reason", "replay", "--db", db_url]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "receipt not checked" in err
    assert "--force to send it anyway" in err
    assert rows(engine)["d-1"]["state"] == "dead"
    assert main([*argv, "--force"]) == 0
    assert "requeued 'd-1'" in capsys.readouterr().out
    [kept] = audit_rows(engine)
    assert (kept["receipt"], kept["forced"]) == ("not checked", True)


def test_dead_list_filters_by_destination_status_error_and_age(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    dead_messages(engine, clock)  # created at 0, 1, 2 and 3 hours; now is 4 hours

    def chosen(**fields: Any) -> list[str]:
        with Operations(db_url, clock=clock) as ops:
            return [row["reply_id"] for row in ops.dead(chosen=DeadFilter(**fields))]

    assert chosen() == ["b-1", "b-2", "s-1", "s-2"]
    assert chosen(destination="shipping") == ["s-1", "s-2"]
    assert chosen(status=410) == ["b-1", "s-1"]
    assert chosen(error="GONE") == ["b-1", "s-1"]  # any case
    assert chosen(error="50%") == []  # the text is matched as it is, not as a pattern
    assert chosen(newer_than=2.5 * 3600) == ["s-1", "s-2"]
    assert chosen(older_than=2.5 * 3600) == ["b-1", "b-2"]
    assert chosen(destination="billing", status=409, older_than=3600) == ["b-2"]
    with Operations(db_url, clock=clock) as ops:
        ages = [row["age"] for row in ops.dead()]
    assert ages == [4 * 3600.0, 3 * 3600.0, 2 * 3600.0, 3600.0]


def test_dead_list_and_show_print_utc_times_and_the_body(
    db_url: str, engine: sa.Engine, clock: ManualClock, capsys: pytest.CaptureFixture[str]
) -> None:
    dead_messages(engine, clock)
    listed = run_json(capsys, "dead", "list", "--db", db_url, "--destination", "billing")
    assert isinstance(listed, list)
    assert [row["reply_id"] for row in listed] == ["b-1", "b-2"]
    assert listed[0]["created"] == "1970-01-12T13:46:40Z"  # the manual clock's start
    filtered = run_json(
        capsys, "dead", "list", "--db", db_url, "--status", "410", "--error", "good"
    )
    assert [row["reply_id"] for row in filtered] == ["s-1"]  # type: ignore[union-attr]
    shown = run_json(capsys, "dead", "show", "s-1", "--db", db_url)
    assert isinstance(shown, dict)
    assert shown["body"] == {"id": "s-1"}
    assert main(["dead", "show", "s-1", "--db", db_url]) == 0
    text = capsys.readouterr().out
    assert '"id": "s-1"' in text
    assert "1970-01-12T15:46:40Z" in text


def test_bulk_requeue_by_filter_with_a_dry_run_first(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    capsys: pytest.CaptureFixture[str],
    no_relay_config: None,
) -> None:
    dead_messages(engine, clock)
    argv = ["dead", "requeue", "--db", db_url, "--status", "410", "--reason", "gone came back"]
    # Nobody can be asked whether the destinations hold them: refused without --force.
    assert main([*argv, "--json"]) == 1
    refused = json.loads(capsys.readouterr().out)
    assert [(r["reply_id"], r["outcome"]) for r in refused] == [
        ("b-1", "refused"),
        ("s-1", "refused"),
    ]
    assert main([*argv, "--force", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would requeue 2, refused 0" in out
    assert {r["state"] for r in rows(engine).values()} == {"dead"}  # a dry run changes nothing
    assert audit_rows(engine) == []
    assert main([*argv, "--force"]) == 0
    assert "requeued 2, refused 0" in capsys.readouterr().out
    states = {reply_id: row["state"] for reply_id, row in rows(engine).items()}
    assert states == {"b-1": "pending", "b-2": "dead", "s-1": "pending", "s-2": "dead"}
    assert sorted(row["reply_id"] for row in audit_rows(engine)) == ["b-1", "s-1"]


def test_requeue_needs_one_reply_id_or_filters(
    db_url: str, engine: sa.Engine, clock: ManualClock, capsys: pytest.CaptureFixture[str]
) -> None:
    dead_messages(engine, clock)
    base = ["dead", "requeue", "--db", db_url, "--reason", "r", "--force"]
    assert main(base) == 2
    assert "needs a REPLY_ID or at least one filter" in capsys.readouterr().err
    assert main([*base, "b-1", "--destination", "billing"]) == 2
    assert "not both" in capsys.readouterr().err
    assert {r["state"] for r in rows(engine).values()} == {"dead"}


def test_bulk_requeue_asks_each_messages_receipt_first(
    db_url: str,
    engine: sa.Engine,
    clock: ManualClock,
    relay_config: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    publish_many(engine, ["held", "lost"], clock=clock)
    for reply_id in ("held", "lost"):
        mark_dead(engine, reply_id)
    with ReceiptStore(db_url) as store:
        store.accept("held", bytes(rows(engine)["held"]["body"]))  # the ACK was lost
    argv = ["dead", "requeue", "--destination", "default", "--reason", "replay"]
    assert main([*argv, "--config", str(relay_config), "--db", db_url, "--json"]) == 1
    done = {
        r["reply_id"]: (r["outcome"], r["receipt"]) for r in json.loads(capsys.readouterr().out)
    }
    assert done == {"held": ("refused", "received"), "lost": ("requeued", "not received")}
    assert {r: row["state"] for r, row in rows(engine).items()} == {
        "held": "dead",
        "lost": "pending",
    }
    [kept] = audit_rows(engine)
    assert (kept["reply_id"], kept["receipt"]) == ("lost", "not received")
