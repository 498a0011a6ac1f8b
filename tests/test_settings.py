"""Settings precedence: flag, then OUTBOX_* environment, then the config file, then default."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from support.cli_helpers import one_line_error

import outbox
from outbox_cli import build_parser, command_options, main
from outbox_cli.settings import DB, DEFAULT_DB, resolve
from outbox_cli.worker import OPTIONS


def worker_args(**given: object) -> argparse.Namespace:
    """A worker's parsed arguments: the flags in `given`, every other one absent."""
    names = {"config": None, "db": None, **{o.dest: None for o in OPTIONS}}
    return argparse.Namespace(**{**names, **given})


def write_config(tmp_path: Path, text: str) -> Path:
    """A TOML config file with `text`."""
    path = tmp_path / "outbox.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_flag_beats_environment_beats_file_beats_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(
        tmp_path,
        'db = "sqlite:///from-file.db"\n[worker]\nhandler = "json:dumps"\n'
        "concurrency = 3\nlease = 12\npoll_interval = 0.5\n",
    )
    monkeypatch.delenv("OUTBOX_DB", raising=False)
    monkeypatch.setenv("OUTBOX_WORKER_LEASE", "20")
    monkeypatch.setenv("OUTBOX_WORKER_POLL_INTERVAL", "0.25")
    args = worker_args(config=str(config), poll_interval=0.1)
    resolve(args, (DB, *OPTIONS))
    assert args.poll_interval == 0.1  # flag
    assert args.lease == 20.0  # environment over file
    assert args.concurrency == 3  # file
    assert args.db == "sqlite:///from-file.db"
    assert (args.grace, args.log_level) == (None, "INFO")  # defaults
    assert args.handler is json.dumps  # parsed from the file like a flag


def test_config_file_named_by_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path, '[worker]\nhandler = "json:dumps"\n')
    monkeypatch.setenv("OUTBOX_CONFIG", str(config))
    monkeypatch.delenv("OUTBOX_DB", raising=False)
    args = worker_args()
    resolve(args, (DB, *OPTIONS))
    assert args.db == DEFAULT_DB
    assert args.handler is not None


@pytest.mark.parametrize(
    ("env", "file_text", "complaint"),
    [
        (
            {"OUTBOX_WORKER_CONCURRENCY": "many", "OUTBOX_WORKER_HANDLER": "json:dumps"},
            "",
            "OUTBOX_WORKER_CONCURRENCY: expected a whole",
        ),
        (
            # A secret pasted into the wrong variable is described, never echoed.
            {
                "OUTBOX_WORKER_CONCURRENCY": "whsec_cmVsYXktdGVzdC1zZWNyZXQ=",
                "OUTBOX_WORKER_HANDLER": "json:dumps",
            },
            "",
            "OUTBOX_WORKER_CONCURRENCY: expected a whole number >= 1, got a value of 30 "
            "characters (not shown: it could be a secret)",
        ),
        (
            {},
            '[worker]\nhandler = "json:dumps"\nconcurrency = 0\n',
            "outbox.toml: worker.concurrency: expected a whole",
        ),
        ({}, '[worker]\nhandler = "nope:nothing"\n', "worker.handler: cannot load 'nope:nothing'"),
        ({}, "", "--handler is required (or OUTBOX_WORKER_HANDLER, or worker.handler"),
        ({}, "not toml [", "cannot read config file"),
    ],
)
def test_a_bad_setting_names_where_it_came_from(
    env: dict[str, str],
    file_text: str,
    complaint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = write_config(tmp_path, file_text)
    args = worker_args(config=str(config))
    with pytest.raises(ValueError, match=re.escape(complaint)):
        resolve(args, (DB, *OPTIONS))


def test_commands_take_the_database_from_the_config_file_unless_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = f"sqlite:///{tmp_path / 'ready.db'}"
    outbox.upgrade(ready)
    config = write_config(tmp_path, f'db = "{ready}"\n')
    monkeypatch.delenv("OUTBOX_DB", raising=False)
    assert main(["status", "--json", "--config", str(config)]) == 0
    assert '"dead": 0' in capsys.readouterr().out
    blank = f"sqlite:///{tmp_path / 'blank.db'}"
    outbox.create_engine(blank).connect().close()  # an empty database file
    monkeypatch.setenv("OUTBOX_DB", blank)
    assert main(["status", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"database {blank} has no outbox schema" in err
    assert err.count("\n") == 1


def test_the_receiver_reads_its_table_of_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(
        tmp_path,
        'db = "sqlite:///shared.db"\n[receiver]\nport = 9100\ntolerance = "10m"\n'
        'secret_file = "/run/secrets/webhook"\n',
    )
    monkeypatch.delenv("OUTBOX_DB", raising=False)
    monkeypatch.setenv("OUTBOX_RECEIVER_PORT", "9200")
    args = build_parser().parse_args(["receiver", "--config", str(config)])
    resolve(args, command_options("receiver"))
    assert (args.db, args.port, args.tolerance) == ("sqlite:///shared.db", 9200, 600.0)
    assert args.secret_file == "/run/secrets/webhook"
    assert (args.host, args.retention) == ("127.0.0.1", None)  # defaults


def test_a_missing_sqlite_file_is_a_typo_not_a_new_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo.db"
    for argv in (["status"], ["dead", "list"], ["worker", "--handler", "json:dumps"]):
        assert main([*argv, "--db", f"sqlite:///{missing}"]) == 2
        err = capsys.readouterr().err
        assert f"no SQLite database at {missing}" in err
        assert err.count("\n") == 1
    assert main(["db", "current", "--db", f"sqlite:///{missing}"]) == 0
    assert capsys.readouterr().out == "no schema\n"
    assert not missing.exists()
    assert main(["db", "upgrade", "--db", f"sqlite:///{missing}"]) == 0
    assert missing.exists()


RELAY_FILE = (
    "[relay]\nlease = 12\nbatch = 40\nmax_attempts = 4\n"
    '[destinations.default]\nurl = "http://127.0.0.1:9/replies"\nunsigned = true\n'
)


def relay_args(argv: list[str]) -> argparse.Namespace:
    """`outbox relay ARGV` parsed and resolved as main() does."""
    args = build_parser().parse_args(["relay", *argv])
    resolve(args, command_options("relay"))
    return args


def test_relay_settings_resolve_like_every_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path, RELAY_FILE)
    for name in ("OUTBOX_RELAY_CONFIG", "OUTBOX_CONFIG", "OUTBOX_DB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OUTBOX_RELAY_BATCH", "80")
    monkeypatch.setenv("OUTBOX_RELAY_MAX_ATTEMPTS", "6")
    args = relay_args(["--config", str(config), "--max-attempts", "9"])
    assert args.max_attempts == 9  # flag over environment over file
    assert args.batch == 80  # environment over file
    assert args.lease == 12.0  # file
    assert (args.backoff, args.log_format, args.metrics_port) == (None, "text", None)


def test_a_bad_relay_value_names_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path, RELAY_FILE)
    monkeypatch.setenv("OUTBOX_RELAY_LEASE", "soon")
    with pytest.raises(ValueError, match=r"^OUTBOX_RELAY_LEASE: expected a positive number"):
        relay_args(["--config", str(config)])
    monkeypatch.delenv("OUTBOX_RELAY_LEASE")
    bad_file = write_config(tmp_path, RELAY_FILE.replace("batch = 40", "batch = 0"))
    with pytest.raises(ValueError, match=r"outbox.toml: relay.batch: expected a whole number"):
        relay_args(["--config", str(bad_file)])


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("attempts = 4", "`attempts` is now called `max_attempts`"),
        ("retries = 4", "[relay]: unknown key `retries`; known: backoff, "),
        ("concurency = 4", "[relay]: unknown key `concurency` (did you mean `concurrency`?)"),
    ],
)
def test_the_relay_refuses_unknown_keys_in_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, said: str
) -> None:
    config = write_config(tmp_path, RELAY_FILE.replace("max_attempts = 4", line))
    db = f"sqlite:///{tmp_path / 'relay.db'}"
    assert main(["db", "upgrade", "--db", db]) == 0
    capsys.readouterr()
    assert main(["relay", "--db", db, "--config", str(config)]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # The value, left over, is read as the receiver's action: shown redacted.
        (["receiver", "--secret", "whsec_c2VjcmV0LXZhbHVlLTAxMjM0NTY3"], "'whsec_<redacted>'"),
        (["receiver", "--secret=whsec_c2VjcmV0LXZhbHVlLTAxMjM0NTY3"], "arguments: --secret "),
        (["relay", "--metrics-por", "9100"], "arguments: --metrics-por "),
        (["dead", "list", "--dest", "billing"], "arguments: --dest "),
    ],
)
def test_options_must_be_spelled_out_and_errors_never_echo_values(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    line = one_line_error(argv, capsys)
    assert said in line
    assert "c2VjcmV0" not in line
    assert "9100" not in line
