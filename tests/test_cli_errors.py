"""Every command ends a failure in one line that names what failed, with an exit status
that says why: 2 setup, 3 database, 4 port (outbox_cli.failures)."""

from __future__ import annotations

import logging
import re
import shutil
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from support.relay_helpers import SECRET

from alembic import command
from outbox.migrations import alembic_config, required_head
from outbox_cli import build_parser, logs, main
from outbox_cli.logs import configure_logging

NATS = "nats://127.0.0.1:4222"


@pytest.fixture(autouse=True)
def logging_restored() -> Iterator[None]:
    """The long-running commands configure logging for their process: put it back after."""
    root = logging.getLogger()
    alembic_logger = logging.getLogger("alembic")
    saved = (root.handlers[:], root.level, alembic_logger.level)
    hooks = (sys.excepthook, threading.excepthook, logs._json)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    alembic_logger.setLevel(saved[2])
    sys.excepthook, threading.excepthook, logs._json = hooks
    logging.captureWarnings(False)


@pytest.fixture(autouse=True)
def one_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's destination, from the environment (every other command ignores it)."""
    for name in ("OUTBOX_DB", "OUTBOX_CONFIG", "OUTBOX_RELAY_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OUTBOX_DESTINATION_DEFAULT_URL", "http://127.0.0.1:9/replies")
    monkeypatch.setenv("OUTBOX_DESTINATION_DEFAULT_UNSIGNED", "true")


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    """A file with the receiver's webhook secret."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return str(path)


def every_command(secret_file: str) -> list[list[str]]:
    """Each command that opens the database, with the arguments it needs besides --db."""
    return [
        ["status"],
        ["status", "--json"],
        ["dead", "list"],
        ["dead", "show", "r-1"],
        ["dead", "requeue", "r-1", "--reason", "retry"],
        ["dead", "resolve", "r-1", "--reason", "gone"],
        ["db", "upgrade"],
        ["db", "current"],
        ["purge", "--older-than", "30d"],
        ["worker", "--handler", "json:dumps"],
        ["relay"],
        ["receiver", "--secret-file", secret_file],
        ["receiver", "upgrade"],
        ["receiver", "purge", "--older-than", "30d"],
        ["receiver", "consume", "--from", NATS, "--stream", "s", "--durable", "d", "--unsigned"],
        ["console"],
        ["demo"],
    ]


def failed(argv: list[str], status: int, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Run `outbox ARGV`: it must exit `status` with one error line, the last on stderr and
    no traceback; (that line, everything printed)."""
    assert main(argv) == status
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "outbox: error:" in line]
    assert len(errors) == 1, err
    assert err.splitlines()[-1] == errors[0], err
    assert "Traceback" not in err
    return errors[0], out + err


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


# SQLAlchemy takes a password holding '/' or '?' unencoded; its start line and error hide it.
@pytest.mark.parametrize("password", ["s3cret", "s3/cret+ef==", "s3?cret"])
def test_an_unreachable_database_is_one_line_naming_it_and_exit_3(
    password: str, refusing_port: int, secret_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"postgresql://app:{password}@127.0.0.1:{refusing_port}/app"
    shown = f"postgresql://app:<redacted>@127.0.0.1:{refusing_port}/app"
    for argv in every_command(secret_file):
        line, printed = failed([*argv, "--db", url], 3, capsys)
        assert line.startswith(f"outbox: error: database {shown}: "), (argv, line)
        assert "Connection refused" in line, (argv, line)
        assert "cret" not in printed, argv


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("nonsense", "database URL 'nonsense' is not a URL: expected postgresql://"),
        # Unparsed, a password cannot be told from a host: all before the last '@' is hidden.
        (
            "postgresql:/app:s3cret@db/app",
            "database URL 'postgresql:/<redacted>@db/app' is not a URL: expected ",
        ),
        (
            "app:s3cret@db:5432/app",
            "database URL 'app:<redacted>@db:5432/app' is not a URL: expected ",
        ),
        (
            "postgresql://app:s3cret@db:5432x/app",
            "database URL 'postgresql://app:<redacted>@db:5432x/app': ",
        ),
        (
            "oracle://app:s3cret@db/app",
            "database URL 'oracle://app:<redacted>@db/app': unsupported database 'oracle'",
        ),
    ],
)
def test_a_malformed_database_url_is_one_line_naming_it_and_exit_2(
    url: str, said: str, secret_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in every_command(secret_file):
        line, printed = failed([*argv, "--db", url], 2, capsys)
        assert line.startswith(f"outbox: error: {said}"), (argv, line)
        assert "s3cret" not in printed, argv


def test_a_dbapi_the_url_names_but_not_installed_is_one_line_and_exit_2(
    secret_file: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "MySQLdb", None)  # mysqlclient absent, installed or not
    for argv in every_command(secret_file):
        line, printed = failed([*argv, "--db", "mysql+mysqldb://app:s3cret@db/app"], 2, capsys)
        assert "needs the Python module 'MySQLdb'" in line, (argv, line)
        assert "s3cret" not in printed, argv


@pytest.fixture
def ready_db(tmp_path: Path, sqlite_template: Path) -> str:
    """A SQLite database with both schemas."""
    shutil.copyfile(sqlite_template, tmp_path / "ready.db")
    return f"sqlite:///{tmp_path / 'ready.db'}"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_port_in_use_is_named_with_its_flag_before_anything_listens(
    ready_db: str, busy_port: int, secret_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    port = str(busy_port)
    consume = ["receiver", "consume", "--from", NATS, "--stream", "s", "--durable", "d"]
    for argv, flag in [
        (["worker", "--handler", "json:dumps", "--metrics-port", port], "--metrics-port"),
        (["relay", "--metrics-port", port], "--metrics-port"),
        (["receiver", "--secret-file", secret_file, "--port", port], "--port"),
        ([*consume, "--unsigned", "--metrics-port", port], "--metrics-port"),
        (["console", "--port", port], "--port"),
    ]:
        line, printed = failed([*argv, "--db", ready_db], 4, capsys)
        assert line == f"outbox: error: port {port} on 127.0.0.1 is in use ({flag})", argv
        assert "listening" not in printed, argv
        assert "console on" not in printed, argv
        # The start line names the database; Alembic's checks of the schema say nothing.
        name = "receiver consume" if argv[:2] == consume[:2] else argv[0]
        assert f"outbox {name}: database {ready_db}, no config file" in printed, printed
        assert "Context impl" not in printed
        assert "transactional DDL" not in printed


def test_alembic_speaks_only_at_debug() -> None:
    configure_logging("text", "INFO")
    assert not logging.getLogger("alembic.runtime.migration").isEnabledFor(logging.INFO)
    configure_logging("text", "DEBUG")
    assert logging.getLogger("alembic.runtime.migration").isEnabledFor(logging.INFO)


def test_the_missing_schema_hint_can_be_pasted(
    pg_blank_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sa.make_url(pg_blank_url).password is None  # a user name, no password
    line, _ = failed(["status", "--db", pg_blank_url], 2, capsys)
    hint = re.search(r"Run: outbox db upgrade --db (\S+)", line)
    assert hint is not None, line
    assert sa.make_url(hint[1]).username == sa.make_url(pg_blank_url).username
    assert main(["db", "upgrade", "--db", hint[1]]) == 0
    assert "created the outbox schema" in capsys.readouterr().out
    assert main(["status", "--db", pg_blank_url]) == 0


def test_db_upgrade_says_what_it_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    head = required_head("outbox")
    assert main(["db", "upgrade", "--db", url]) == 0
    assert capsys.readouterr().out == f"{url}: created the outbox schema at revision {head}\n"
    assert main(["db", "upgrade", "--db", url, "--receiver"]) == 0
    assert capsys.readouterr().out == (
        f"{url}: the outbox schema is up to date at revision {head}\n"
        f"{url}: created the receiver schema at revision {required_head('receiver')}\n"
    )
    older = ScriptDirectory.from_config(alembic_config()).get_revision(head).down_revision
    assert isinstance(older, str)
    behind = f"sqlite:///{tmp_path / 'behind.db'}"
    with sa.create_engine(behind).begin() as connection:
        command.upgrade(alembic_config(connection), older)
    assert main(["db", "upgrade", "--db", behind]) == 0
    assert capsys.readouterr().out == (
        f"{behind}: upgraded the outbox schema from revision {older} to {head}\n"
    )


def test_one_shot_commands_name_their_database_first(
    ready_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["status"], ["dead", "list"]):
        assert main([*argv, "--db", ready_db]) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"database {ready_db}"


def test_consume_options_are_taken_before_consume_and_refused_elsewhere(
    secret_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(
        ["receiver", "--metrics-port", "9464", "--from", NATS, "consume", "--queue", "q"]
    )
    assert (args.metrics_port, getattr(args, "from"), args.queue) == (9464, NATS, "q")
    line, _ = failed(
        ["receiver", "--secret-file", secret_file, "--metrics-port", "9464"], 2, capsys
    )
    assert line == (
        "outbox: error: --metrics-port is an option of `outbox receiver consume`; the HTTP "
        "receiver serves /metrics, /healthz and /readyz on its own --port"
    )


def test_a_short_secret_says_how_to_make_one(
    ready_db: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OUTBOX_DESTINATION_DEFAULT_UNSIGNED")
    monkeypatch.setenv("OUTBOX_DESTINATION_DEFAULT_SECRET", "whsec_mysecret")
    line, printed = failed(["relay", "--db", ready_db], 2, capsys)
    assert "shorter than 16 bytes" in line
    assert "make one with `outbox secret new`" in line
    assert "mysecret" not in printed


def test_receipt_purge_prints_durations_as_given(
    ready_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["receiver", "purge", "--older-than", "30d", "--db", ready_db]) == 0
    assert capsys.readouterr().out == "purged 0 receipt(s) older than 30d\n"
