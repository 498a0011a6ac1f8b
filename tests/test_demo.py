"""`outbox demo`: the story runs end to end, and its invariants hold in the databases."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox.receiver_tables import effects, receipts
from outbox.schema import messages, tasks
from outbox_cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_demo(*argv: str) -> str:
    """`outbox demo ARGV` as a real process; its output, after checking it exited 0."""
    done = subprocess.run(
        [sys.executable, "-m", "outbox_cli", "demo", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rows(url: str, query: sa.Select[tuple[object, ...]]) -> list[sa.Row[tuple[object, ...]]]:
    """All rows of `query` on the database at `url`."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(query))
    finally:
        engine.dispose()


def test_demo_leaves_every_task_done_and_every_reply_applied_once(
    backend: str, db_url: str, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        # The embedded default: SQLite files in a folder of the demo's own, kept here.
        output = run_demo("--keep")
        [kept] = [line for line in output.splitlines() if line.startswith("kept: ")]
        folder = Path(kept.removeprefix("kept: "))
        request.addfinalizer(lambda: shutil.rmtree(folder))
        outbox_url = f"sqlite:///{folder / 'outbox.db'}"
        receiver_url = f"sqlite:///{folder / 'receiver.db'}"
    else:
        run_demo("--db", db_url)
        outbox_url = receiver_url = db_url
    task_rows = rows(outbox_url, sa.select(tasks.c.task_id, tasks.c.state, tasks.c.fence))
    assert sorted(row.state for row in task_rows) == ["done"] * 3
    # The crashed worker's tasks were recovered under a higher fence: the one whose
    # commit it died in, and the next one when it had already taken it (a slot takes
    # its next task while the last result commits).
    assert sorted(row.fence for row in task_rows) in ([1, 1, 2], [1, 2, 2])
    replies = {
        row.reply_id: row
        for row in rows(
            outbox_url,
            sa.select(
                messages.c.reply_id,
                messages.c.task_id,
                messages.c.state,
                messages.c.attempts,
                messages.c.content_hash,
            ),
        )
    }
    assert len(replies) == 4  # one per task, one published
    assert sorted(r.task_id for r in replies.values() if r.task_id) == sorted(
        row.task_id for row in task_rows
    )
    # Sent, after the lost ACK made the relay send each twice.
    assert {(r.state, r.attempts) for r in replies.values()} == {("sent", 2)}
    held = dict(rows(receiver_url, sa.select(receipts.c.reply_id, receipts.c.content_hash)))
    assert held == {reply_id: r.content_hash for reply_id, r in replies.items()}
    applied = sorted(r.reply_id for r in rows(receiver_url, sa.select(effects.c.reply_id)))
    assert applied == sorted(replies)  # exactly one effect each


def test_demo_cleans_up_after_itself_without_keep() -> None:
    output = run_demo()
    assert "all invariants held" in output
    [line] = [line for line in output.splitlines() if line.startswith("outbox database:")]
    folder = Path(line.removeprefix("outbox database:").strip().removeprefix("sqlite:///")).parent
    assert not folder.exists()


def test_demo_refuses_a_database_that_already_holds_work(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its workers and relay would take that work too: a real application's replies
    # would go to the demo's throwaway receiver.
    engine = outbox.create_engine(db_url)
    try:
        with Session(engine) as session, session.begin():
            outbox.publish(session, "billing", "app-reply-1", {"n": 1})
    finally:
        engine.dispose()
    assert main(["demo", "--db", db_url]) == 2
    assert "already holds rows in outbox_messages" in capsys.readouterr().err
    [row] = rows(db_url, sa.select(messages.c.reply_id, messages.c.state, messages.c.attempts))
    assert tuple(row) == ("app-reply-1", "pending", 0)
