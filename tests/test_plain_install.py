"""A plain install (`pip install outbox-relay`, no extras) runs every command.

Each command here runs as a real process in which every module an extra (or the
`dev` and `bench` tools) brings is unimportable (support/plain_install.py). What
needs a missing extra says which, in one line, and exits 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from support.console_helpers import ConsoleProcess
from support.plain_install import blocked_modules, plain_install_variables
from support.receiver_helpers import (
    ROOT,
    SECRET,
    ReceiverProcess,
    signed,
    stored_receipts,
    wait_until,
)
from support.relay_helpers import publish_many, rows

import outbox
from outbox_cli import build_parser
from receiver import strict_json

EXTRA_MODULES = ("httptools", "uvloop", "orjson", "nats", "aio_pika", "aiormq")
DEV_MODULES = ("httpx", "fastapi", "standardwebhooks", "pytest")
BASE_MODULES = ("sqlalchemy", "alembic", "uvicorn", "h11", "starlette", "aiohttp", "jinja2")
WAIT = 90.0  # seconds for a process to answer: generous, the machine may be loaded


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process this test starts runs as a plain install."""
    for name, value in plain_install_variables().items():
        monkeypatch.setenv(name, value)


def outbox_command(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`outbox ARGV` as a real process, in the current environment; it must end in time."""
    return subprocess.run(
        [sys.executable, "-m", "outbox_cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def succeeds(*argv: str, cwd: Path = ROOT) -> str:
    """`outbox ARGV`'s standard output, after checking that it exited 0."""
    done = outbox_command(*argv, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def fails_in_one_line(*argv: str, cwd: Path = ROOT) -> str:
    """`outbox ARGV`'s one error line, after checking that it exited 2 and said nothing else
    on standard error than its start line."""
    done = outbox_command(*argv, cwd=cwd)
    assert done.returncode == 2, done.stdout + done.stderr
    *before, error = done.stderr.splitlines()
    assert error.startswith("outbox: error: "), done.stderr
    assert all(" INFO outbox.cli " in line for line in before), done.stderr
    return error


def loaded(pid: int, module: str) -> bool:
    """Whether `module`'s compiled extension is mapped into the process (Linux /proc)."""
    return f"/{module}/" in Path(f"/proc/{pid}/maps").read_text(encoding="utf-8")


def test_the_extras_and_the_tools_are_what_a_plain_install_lacks() -> None:
    blocked = set(blocked_modules())
    installed = {module for module in (*EXTRA_MODULES, *DEV_MODULES) if _importable_here(module)}
    assert installed <= blocked
    assert not blocked & set(BASE_MODULES)


def _importable_here(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_a_plain_process_cannot_import_an_extra(plain: None) -> None:
    probe = (
        "import importlib.util, sys\n"
        f"for name in {EXTRA_MODULES!r}:\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        sys.exit(f'{name} imported')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def _commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every command and subcommand the parser knows, as its argv words."""
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))


def test_every_command_answers_help(plain: None) -> None:
    commands = list(_commands(build_parser()))
    assert ("receiver", "consume") in commands
    assert "usage: outbox" in succeeds("--help")
    # One process walks the rest: every command module is imported before any --help.
    walk = (
        "import json, sys\n"
        "from outbox_cli import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        main([*argv, '--help'])\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, (argv, exit.code)\n"
        "    else:\n"
        "        raise AssertionError(f'{argv} --help did not exit')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", walk, json.dumps(commands)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for command in commands[1:]:
        assert f"usage: outbox {' '.join(command)}" in done.stdout


def test_the_demo_runs(plain: None, tmp_path: Path) -> None:
    # Its worker and receiver are processes of their own, plain too; its relay posts batches.
    assert succeeds("demo", cwd=tmp_path).rstrip().endswith("all invariants held")


@pytest.fixture
def outbox_db(plain: None, tmp_path: Path) -> str:
    """An outbox database (SQLite) made by a plain `outbox db upgrade`."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    succeeds("db", "upgrade", "--db", url)
    return url


@pytest.fixture
def receiver_db(plain: None, tmp_path: Path) -> str:
    """A receiver database (SQLite) made by a plain `outbox receiver upgrade`."""
    url = f"sqlite:///{tmp_path / 'receiver.db'}"
    succeeds("receiver", "upgrade", "--db", url)
    return url


def test_a_message_goes_from_the_relay_to_the_receiver(
    outbox_db: str, receiver_db: str, tmp_path: Path
) -> None:
    outbox_url, receiver_url = outbox_db, receiver_db
    secret_file = tmp_path / "secrets"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    receiver = ReceiverProcess(receiver_url, secret_file)
    try:
        receiver.wait_ready(timeout=WAIT)
        assert not loaded(receiver.proc.pid, "httptools")  # h11 parses here
        assert not loaded(receiver.proc.pid, "orjson")
        config = tmp_path / "relay.toml"
        config.write_text(
            "[relay]\npoll_interval = 0.05\n"
            f'[destinations.default]\nurl = "{receiver.base}/replies"\n'
            f'secret_file = "{secret_file}"\ntimeout = 5\n',
            encoding="utf-8",
        )
        engine = outbox.create_engine(outbox_url)
        try:
            publish_many(engine, ["plain-1", "plain-2"])
            relay = subprocess.Popen(
                [sys.executable, "-m", "outbox_cli", "relay", "--db", outbox_url,
                 "--config", str(config)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            try:
                wait_until(lambda: _delivered(engine, relay), WAIT, "both messages delivered")
            finally:
                status, err = _stopped(relay)
            assert status == 0, err
        finally:
            engine.dispose()
        assert set(stored_receipts(receiver_url)) == {"plain-1", "plain-2"}
        _refuses_what_the_exact_parse_refuses(receiver)
    finally:
        receiver.stop()
    status = json.loads(succeeds("status", "--json", "--db", outbox_url))
    assert status["messages"]["sent"] == 2
    succeeds("dead", "list", "--db", outbox_url)


def _delivered(engine: sa.Engine, relay: subprocess.Popen[bytes]) -> bool:
    """Whether every message is sent; fails at once if the relay has exited."""
    if relay.poll() is not None:
        raise AssertionError(f"the relay exited with {relay.returncode}: {_stopped(relay)[1]}")
    return {row["state"] for row in rows(engine).values()} == {"sent"}


def _stopped(process: subprocess.Popen[bytes]) -> tuple[int, str]:
    """SIGTERM (killed if it does not end in time), reaped: its exit status and stderr."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return process.returncode, err.decode(errors="replace")


def _refuses_what_the_exact_parse_refuses(receiver: ReceiverProcess) -> None:
    """Without orjson the receiver refuses a body for the exact parse's reason."""
    body = b'{"kind":"result","task_id":"t","status":"done","result":{"a":1,"a":2}}'
    with pytest.raises(strict_json.InvalidJSON) as exact:
        strict_json._exact(body, strict_json.MAX_DEPTH)
    answer = httpx.post(
        receiver.base + "/replies", content=body, headers=signed("plain-dup", body), timeout=30
    )
    assert answer.status_code == 400, answer.text
    assert str(exact.value) in answer.text


@pytest.fixture(params=["httptools", "h11"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The HTTP parser the processes this test starts run: httptools, or h11 as installed plain."""
    if request.param == "httptools":
        pytest.importorskip("httptools")
    else:
        for name, value in plain_install_variables().items():
            monkeypatch.setenv(name, value)
    return str(request.param)


def test_the_console_serves_and_limits_headers_alike(parser: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    outbox.upgrade(url)
    console = ConsoleProcess(url, tmp_path / "console.log")
    try:
        console.wait_ready(timeout=WAIT)
        assert loaded(console.proc.pid, "httptools") == (parser == "httptools")
        page = httpx.get(console.base + "/", timeout=30, follow_redirects=True)
        assert page.status_code == 200, page.text[:200]
        # The receiver's header limit (64 KiB) on either parser; h11 alone would say 400.
        within = httpx.get(console.base + "/", headers={"x-pad": "a" * 60_000}, timeout=30)
        assert within.status_code == 200
        with socket.create_connection(("127.0.0.1", console.port), timeout=30) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: c\r\nX-Pad: " + b"a" * 70_000)
            assert sock.recv(65536).startswith(b"HTTP/1.1 431")
    finally:
        console.stop()


BROKER_TABLES = {
    "nats": 'kind = "nats"\nurl = "nats://127.0.0.1:4222"\nstream = "S"\nsubject = "s"\n',
    "rabbitmq": 'kind = "rabbitmq"\nurl = "amqp://127.0.0.1:5672/"\nexchange = "x"\n'
    'routing_key = "k"\n',
}


@pytest.mark.parametrize("extra", sorted(BROKER_TABLES))
def test_a_broker_destination_names_its_extra(outbox_db: str, tmp_path: Path, extra: str) -> None:
    config = tmp_path / "relay.toml"
    table = BROKER_TABLES[extra] + "unsigned = true\n"
    config.write_text(f"[destinations.events]\n{table}", encoding="utf-8")
    line = fails_in_one_line("relay", "--db", outbox_db, "--config", str(config))
    assert f"pip install 'outbox-relay[{extra}]'" in line


CONSUMERS = {
    "nats": ("--from", "nats://127.0.0.1:4222", "--stream", "S", "--durable", "D"),
    "rabbitmq": ("--from", "amqp://127.0.0.1:5672/", "--queue", "q"),
}


@pytest.mark.parametrize("extra", sorted(CONSUMERS))
def test_consuming_from_a_broker_names_its_extra(receiver_db: str, extra: str) -> None:
    line = fails_in_one_line(
        "receiver", "consume", "--db", receiver_db, *CONSUMERS[extra], "--unsigned"
    )
    assert f"pip install 'outbox-relay[{extra}]'" in line
