"""The migrations the distribution ships: found where the package is, and they build both
schemas through `outbox db upgrade`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import sqlalchemy as sa

import outbox
from outbox.migrations import (
    OUTBOX_BRANCH,
    RECEIVER_BRANCH,
    VERSION_TABLE,
    required_head,
    script_location,
)

TABLES = {
    "outbox_inbox",
    "outbox_tasks",
    "outbox_messages",
    "outbox_requeues",
    "outbox_relays",
    "outbox_workers",
    "outbox_task_decisions",
    "outbox_failed_attempts",
    "outbox_backlog_samples",
    "receiver_receipts",
    "receiver_effects",
    "receiver_dead_letters",
    VERSION_TABLE,
}


def test_the_migrations_are_the_copy_under_tests_own(expected_home: Path) -> None:
    scripts = script_location()
    assert scripts.resolve().is_relative_to(expected_home), scripts
    assert (scripts / "env.py").is_file()
    assert (scripts / "script.py.mako").is_file()
    for branch in (OUTBOX_BRANCH, RECEIVER_BRANCH):
        assert list((scripts / "versions" / branch).glob("*.py")), f"no {branch} migrations"


def test_db_upgrade_builds_both_schemas_at_their_heads(
    tmp_path: Path, command: Callable[..., CompletedProcess[str]]
) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    done = command("db", "upgrade", "--receiver", "--json", "--db", url)
    assert done.returncode == 0, done.stdout + done.stderr
    heads = {required_head(OUTBOX_BRANCH), required_head(RECEIVER_BRANCH)}
    assert set(json.loads(done.stdout)["revisions"]) == heads
    current = command("db", "current", "--json", "--db", url)
    assert current.returncode == 0, current.stdout + current.stderr
    assert set(json.loads(current.stdout)["revisions"]) == heads
    engine = outbox.create_engine(url)
    try:
        assert set(sa.inspect(engine).get_table_names()) == TABLES
    finally:
        engine.dispose()
