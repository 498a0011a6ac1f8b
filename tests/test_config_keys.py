"""The config file: every table and key a command does not read is refused, with what was meant."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from outbox.errors import ConfigError
from outbox.unknown_keys import refuse_unknown
from outbox_cli import main
from relay.config import destinations_from


def refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, *argv: str) -> str:
    """`outbox ARGV --config FILE` with `text` as the file: exit 2 and one line; that line."""
    config = tmp_path / "outbox.toml"
    config.write_text(text, encoding="utf-8")
    # Refused before the database is opened: this one does not even exist.
    db = f"sqlite:///{tmp_path / 'never-opened.db'}"
    assert main([*argv, "--db", db, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removeprefix(f"outbox: error: {config}: ").rstrip("\n")


@pytest.mark.parametrize("argv", [["status"], ["worker", "--handler", "json:dumps"]])
@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('dbb = "postgresql://app@db/app"\n', "unknown key `dbb` (did you mean `db`?)"),
        (
            "[worker]\nconcurency = 4\n",
            "[worker]: unknown key `concurency` (did you mean `concurrency`?)",
        ),
        ("[receiver]\nprot = 18040\n", "[receiver]: unknown key `prot` (did you mean `port`?)"),
        (
            "[console]\nread_onyl = true\n",
            "[console]: unknown key `read_onyl` (did you mean `read_only`?)",
        ),
        ("[relay]\nbatchsize = 10\n", "[relay]: unknown key `batchsize` (did you mean `batch`?)"),
        ("[relay]\nattempts = 3\n", "[relay]: `attempts` is now called `max_attempts`"),
        (
            '[destination.billing]\nurl = "http://127.0.0.1:9/"\n',
            "unknown table [destination.billing] (did you mean [destinations.billing]?)",
        ),
        (
            '[destinations.billing]\nurll = "http://127.0.0.1:9/"\n',
            "[destinations.billing]: unknown key `urll` (did you mean `url`?)",
        ),
        ("[consol]\nport = 8081\n", "unknown table [consol] (did you mean [console]?)"),
        ("worker = 4\n", "`worker` must be a table: [worker]"),
    ],
)
def test_a_typo_anywhere_in_the_file_is_refused_by_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], text: str, said: str
) -> None:
    assert refusal(tmp_path, capsys, text, *argv) == said


def test_without_a_near_name_the_known_ones_are_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refusal(tmp_path, capsys, "[metrics]\nport = 9464\n", "status")
    assert line == (
        "unknown table [metrics]; the top level holds db, [console], [destinations.NAME], "
        "[receiver], [relay], [worker]"
    )
    line = refusal(tmp_path, capsys, "[worker]\nzzz = 1\n", "status")
    assert line.startswith("[worker]: unknown key `zzz`; known: concurrency, grace, handler")


def test_a_file_of_every_commands_tables_is_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sqlite_template: Path
) -> None:
    shutil.copyfile(sqlite_template, tmp_path / "ready.db")
    db = f"sqlite:///{tmp_path / 'ready.db'}"
    config = tmp_path / "outbox.toml"
    config.write_text(
        f'db = "{db}"\n[worker]\nconcurrency = 4\n[relay]\nbatch = 10\n[receiver]\nport = 18040\n'
        '[console]\nport = 8081\n[destinations.billing]\nurl = "http://127.0.0.1:9/"\n'
        "unsigned = true\n",
        encoding="utf-8",
    )
    assert main(["status", "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith(f"database {db}\n")


def test_destination_tables_from_the_library_use_the_same_refusal() -> None:
    document = {"destinations": {"billing": {"url": "http://127.0.0.1:9/", "timout": 3}}}
    with pytest.raises(ConfigError, match=r"unknown key `timout` \(did you mean `timeout`\?\)"):
        destinations_from(document, "relay.toml", {})


def test_a_rename_is_named_before_a_near_name() -> None:
    with pytest.raises(ConfigError, match="`attempts` is now called `max_attempts`"):
        refuse_unknown("[relay]", ["attempts"], ["max_attempts"], {"attempts": "max_attempts"})
    refuse_unknown("[relay]", ["max_attempts"], ["max_attempts"])  # a known key passes
