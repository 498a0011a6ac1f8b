"""`outbox db upgrade|current` and the demo, through the command's own entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outbox import TaskQueue
from outbox.migrations import required_head
from outbox_cli import main


def test_db_upgrade_then_current(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["db", "current", "--db", url]) == 0
    assert capsys.readouterr().out.strip() == "no schema"
    assert main(["db", "upgrade", "--db", url]) == 0
    capsys.readouterr()
    assert main(["db", "current", "--db", url]) == 0
    assert capsys.readouterr().out.strip() == required_head("outbox")
    TaskQueue(url).close()


def test_unsupported_database_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--db", "oracle://localhost/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("outbox: error: database URL 'oracle://localhost/x': ")
    assert "unsupported database 'oracle'" in err
    assert err.count("\n") == 1


def test_db_commands_speak_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["db", "current", "--json", "--db", url]) == 0
    assert json.loads(capsys.readouterr().out) == {"revisions": []}
    assert main(["db", "upgrade", "--receiver", "--json", "--db", url]) == 0
    revisions = json.loads(capsys.readouterr().out)["revisions"]
    assert sorted(revisions) == sorted([required_head("outbox"), required_head("receiver")])
