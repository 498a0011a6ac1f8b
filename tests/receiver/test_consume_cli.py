"""`outbox receiver consume`: its settings, and one-line errors for what cannot work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.receiver_helpers import SECRET

from outbox.errors import ConfigError
from outbox_cli import build_parser, command_options, main
from outbox_cli.settings import resolve
from receiver import NatsConsumer, RabbitMQConsumer, ReceiptStore


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A secret file holding the tests' secret."""
    path = tmp_path / "secrets"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ([], "--from is required"),
        (["--from", "nats://127.0.0.1:4222", "--stream", "S"], "--stream and --durable"),
        (["--from", "nats://h:4222", "--stream", "S", "--durable", "D", "--queue", "Q"], "--queue"),
        (["--from", "amqp://guest:guest@127.0.0.1:5672/"], "needs --queue"),
        (["--from", "amqp://h/", "--queue", "Q", "--stream", "S"], "for NATS"),
        (["--from", "http://127.0.0.1/", "--queue", "Q"], "must start with nats://"),
    ],
)
def test_a_source_that_cannot_work_is_one_line_and_exit_2(
    db_url: str,
    secret_file: Path,
    arguments: list[str],
    said: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["receiver", "consume", "--db", db_url, "--secret-file", str(secret_file)]
    assert main([*argv, *arguments]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "guest:guest" not in err


def test_unsigned_and_a_secret_file_are_refused_together(
    db_url: str, secret_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["receiver", "consume", "--db", db_url, "--secret-file", str(secret_file)]
    argv += ["--unsigned", "--from", "amqp://h/", "--queue", "Q"]
    assert main(argv) == 2
    assert "choose one" in capsys.readouterr().err


def test_settings_come_from_the_environment_and_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text(
        '[receiver]\nstream = "ORDERS"\ndurable = "billing"\nunsigned = true\nbatch = 50\n'
        "max_deliveries = 8\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("OUTBOX_RECEIVER_FROM", "nats://127.0.0.1:4222")
    monkeypatch.setenv("OUTBOX_RECEIVER_ACK_WAIT", "90")
    args = build_parser().parse_args(["receiver", "--config", str(config), "consume"])
    resolve(args, command_options("receiver"))
    assert getattr(args, "from") == "nats://127.0.0.1:4222"
    assert (args.stream, args.durable, args.unsigned) == ("ORDERS", "billing", True)
    assert (args.batch, args.ack_wait) == (50, 90.0)
    assert args.max_deliveries == 8


def test_max_deliveries_defaults_to_five_and_refuses_less_than_one(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["receiver", "consume"])
    resolve(args, command_options("receiver"))
    assert args.max_deliveries == 5
    monkeypatch.setenv("OUTBOX_RECEIVER_MAX_DELIVERIES", "0")
    argv = ["receiver", "consume", "--db", db_url, "--unsigned", "--from", "amqp://h/"]
    assert main([*argv, "--queue", "Q"]) == 2
    assert "OUTBOX_RECEIVER_MAX_DELIVERIES: expected a whole number >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["receiver", "consume", "--max-deliveries", "0"])
    assert "--max-deliveries: expected a whole number >= 1" in capsys.readouterr().err


def test_a_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_RECEIVER_QUEUE", "from-env")
    args = build_parser().parse_args(["receiver", "consume", "--queue", "from-flag"])
    resolve(args, command_options("receiver"))
    assert args.queue == "from-flag"
    assert args.unsigned is False


@pytest.mark.parametrize(
    ("module", "build", "extra"),
    [
        ("nats", lambda store: NatsConsumer(store, url="nats://h:1", stream="S", durable="D",
                                            unsigned=True), "outbox-relay[nats]"),
        ("aio_pika", lambda store: RabbitMQConsumer(store, url="amqp://h/", queue="Q",
                                                    unsigned=True), "outbox-relay[rabbitmq]"),
    ],
)  # fmt: skip
def test_a_missing_client_library_says_which_extra_to_install(
    db_url: str, monkeypatch: pytest.MonkeyPatch, module: str, build: object, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    store = ReceiptStore(db_url)
    try:
        with pytest.raises(ConfigError, match=extra.replace("[", r"\[").replace("]", r"\]")):
            build(store)  # type: ignore[operator]
    finally:
        store.close()


def test_a_consumer_needs_secrets_or_unsigned(db_url: str) -> None:
    store = ReceiptStore(db_url)
    try:
        with pytest.raises(ConfigError, match="no secret"):
            RabbitMQConsumer(store, url="amqp://h/", queue="Q")
        with pytest.raises(ConfigError, match="choose one"):
            RabbitMQConsumer(store, url="amqp://h/", queue="Q", secrets=[SECRET], unsigned=True)
    finally:
        store.close()


def test_the_receiver_imports_no_broker_library_until_a_consumer_is_built() -> None:
    import subprocess

    code = (
        "import sys, receiver, outbox_cli\n"
        "loaded = {'nats', 'aio_pika'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
