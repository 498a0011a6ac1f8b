"""Destinations from a file, from OUTBOX_DESTINATION_* variables or both, and the refusal
of OUTBOX_* variables that no command reads."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.processes import PROCESS_EXIT, PROCESS_START, reap
from support.receiver_helpers import ROOT, wait_until
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import ScriptedServer

from outbox.errors import ConfigError
from outbox_cli import main
from relay.config import destination_variable, destinations_from, make_destination
from relay.transports.nats import NatsOptions

OTHER_SECRET = "whsec_" + base64.b64encode(b"the file names this one").decode()
FILE = {
    "destinations": {
        "billing": {"url": "https://billing.example/hooks", "secret_env": "BILLING_KEY"},
    }
}


def test_a_destination_defined_only_by_the_environment() -> None:
    env = {
        "OUTBOX_DESTINATION_BILLING_URL": "https://billing.example/hooks",
        "OUTBOX_DESTINATION_BILLING_SECRET": SECRET,
        "OUTBOX_DESTINATION_BILLING_MODE": "batch",
        "OUTBOX_DESTINATION_BILLING_BATCH_URL": "https://billing.example/many",
        "OUTBOX_DESTINATION_BILLING_TIMEOUT": "2.5",
        "OUTBOX_DESTINATION_BILLING_MAX_BATCH_ITEMS": "50",
        "OUTBOX_DESTINATION_BILLING_RECEIPT_LOOKUP": "true",
        "OUTBOX_DESTINATION_BILLING_REQUIRE_RETENTION": "no",
        "OUTBOX_DESTINATION_EU_ORDERS_URL": "http://orders.eu.example/in",
        "OUTBOX_DESTINATION_EU_ORDERS_SECRET": SECRET,
    }
    found = destinations_from({}, None, env)
    assert found == {
        "billing": make_destination(
            "https://billing.example/hooks",
            secret=SECRET,
            mode="batch",
            batch_url="https://billing.example/many",
            timeout=2.5,
            max_batch_items=50,
            receipt_lookup=True,
            require_retention=False,
        ),
        "eu_orders": make_destination("http://orders.eu.example/in", secret=SECRET),
    }
    assert found["billing"].secret == SECRET  # repr hides it, equality does not


def test_the_environment_wins_over_the_file_key_by_key() -> None:
    env = {
        "BILLING_KEY": OTHER_SECRET,
        "OUTBOX_DESTINATION_BILLING_TIMEOUT": "3",
    }
    found = destinations_from(FILE, "relay.toml", env)["billing"]
    assert (found.url, found.timeout, found.secret) == (
        "https://billing.example/hooks",
        3.0,
        OTHER_SECRET,
    )
    # A secret given in the environment replaces the file's way of finding one.
    env = {"OUTBOX_DESTINATION_BILLING_SECRET": SECRET}
    assert destinations_from(FILE, "relay.toml", env)["billing"].secret == SECRET


@pytest.mark.parametrize(
    ("document", "env", "said"),
    [
        ({}, {}, "at least one destination is required"),
        ({}, {"OUTBOX_DESTINATION_BILLING_SECRET": SECRET}, "url is required"),
        ({}, {"OUTBOX_DESTINATION_BILLING_URL": ""}, "OUTBOX_DESTINATION_BILLING_URL is set but"),
        ({}, {"OUTBOX_DESTINATION_BILLING_URLS": "x"}, "expected OUTBOX_DESTINATION_<NAME>_<KEY>"),
        ({}, {"OUTBOX_DESTINATION_URL": "http://x.example"}, "expected OUTBOX_DESTINATION_"),
        (
            {},
            {"OUTBOX_DESTINATION_B_URL": "http://b.example", "OUTBOX_DESTINATION_B_TIMEOUT": "x"},
            r"OUTBOX_DESTINATION_B_\*: timeout: expected a number, got 'x'",
        ),
        (
            # A secret in the wrong variable: the error names the variable, never the value.
            {},
            {
                "OUTBOX_DESTINATION_B_URL": "http://b.example",
                "OUTBOX_DESTINATION_B_TIMEOUT": SECRET,
            },
            r"timeout: expected a number, got a value of \d+ characters \(not shown",
        ),
        (
            {},
            {
                "OUTBOX_DESTINATION_B_URL": "http://b.example",
                "OUTBOX_DESTINATION_B_RECEIPT_LOOKUP": "maybe",
            },
            "receipt_lookup: expected true or false",
        ),
        (
            {"destinations": {"b": {"url": "http://b.example", "receipt_lookup": 1}}},
            {},
            r"relay.toml: destinations.b: receipt_lookup: expected true or false, got 1",
        ),
        (
            {"destinations": {"b": {"url": "http://b.example", "timeout": True}}},
            {},
            "timeout: expected a number, got True",
        ),
        (
            {"destinations": {"b": {"url": "http://b.example", "secret": SECRET}}},
            {},
            "a secret is not written in the file",
        ),
        (
            {
                "destinations": {
                    "b": {"url": "http://b.example", "secret_env": "X", "secret_file": "f"}
                }
            },
            {},
            "give one of secret_file, secret_env, not several",
        ),
        (
            {"destinations": {"b": {"url": "http://b.example", "secret_env": "UNSET_SECRET"}}},
            {},
            r"secret_env: \$UNSET_SECRET is not set",
        ),
        (
            {"destinations": {"b": {"url": "http://b.example:99999/replies", "unsigned": True}}},
            {},
            "Port out of range",
        ),
    ],
)
def test_bad_destinations_are_refused_naming_where_they_came_from(
    document: dict[str, object], env: dict[str, str], said: str
) -> None:
    with pytest.raises(ConfigError, match=said) as refused:
        destinations_from(document, "relay.toml", env)
    assert SECRET[6:] not in str(refused.value)


@pytest.mark.parametrize(
    ("variable", "named"),
    [
        ("OUTBOX_DESTINATION_BILLING_URL", ("billing", "url")),
        ("OUTBOX_DESTINATION_BILLING_BATCH_URL", ("billing", "batch_url")),
        ("OUTBOX_DESTINATION_BILLING_SECRET_FILE", ("billing", "secret_file")),
        ("OUTBOX_DESTINATION_A_B_C_MAX_BATCH_BYTES", ("a_b_c", "max_batch_bytes")),
        ("OUTBOX_DESTINATION_BILLING", None),
        ("OUTBOX_DESTINATION_BILLING_COLOUR", None),
        ("OUTBOX_RELAY_BATCH", None),
    ],
)
def test_destination_variables_are_read_by_their_longest_key(
    variable: str, named: tuple[str, str] | None
) -> None:
    assert destination_variable(variable) == named


@pytest.mark.parametrize(
    ("variable", "said"),
    [
        (
            "OUTBOX_RELAY_BACH",
            "unknown environment variable OUTBOX_RELAY_BACH (did you mean OUTBOX_RELAY_BATCH?)",
        ),
        ("OUTBOX_DATABASE", "unknown environment variable OUTBOX_DATABASE"),
        ("OUTBOX_DESTINATION_BILLING_URI", "unknown environment variable OUTBOX_DESTINATION_"),
    ],
)
def test_an_unknown_outbox_variable_is_an_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    said: str,
) -> None:
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert main(["db", "upgrade", "--db", db]) == 0
    capsys.readouterr()
    monkeypatch.setenv(variable, "1")
    assert main(["status", "--db", db]) == 2
    assert said in capsys.readouterr().err


def test_known_and_referenced_variables_are_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert main(["db", "upgrade", "--db", db]) == 0
    config = tmp_path / "relay.toml"
    config.write_text(
        '[destinations.billing]\nurl = "http://b.example"\nsecret_env = "OUTBOX_BILLING_KEY"\n',
        encoding="utf-8",
    )
    # Another command's setting (a shared env file), a destination, a secret the file names.
    monkeypatch.setenv("OUTBOX_WORKER_CONCURRENCY", "4")
    monkeypatch.setenv("OUTBOX_DESTINATION_ORDERS_URL", "http://o.example")
    monkeypatch.setenv("OUTBOX_BILLING_KEY", SECRET)
    capsys.readouterr()
    assert main(["status", "--db", db, "--config", str(config)]) == 0, capsys.readouterr().err


def test_a_sidecar_runs_from_the_environment_alone(
    db_url: str, engine: sa.Engine, server: ScriptedServer
) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OUTBOX_")}
    env.update(
        {
            "OUTBOX_DB": db_url,
            "OUTBOX_DESTINATION_DEFAULT_URL": server.url,
            "OUTBOX_DESTINATION_DEFAULT_SECRET": SECRET,
            "OUTBOX_DESTINATION_DEFAULT_TIMEOUT": "5",
            "OUTBOX_RELAY_LEASE": "10",
            "OUTBOX_RELAY_POLL_INTERVAL": "0.05",
        }
    )
    publish_many(engine, ["env-1", "env-2"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_cli", "relay"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(
            lambda: {row["state"] for row in rows(engine).values()} == {"sent"},
            PROCESS_START,
            "the relay to start and deliver",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=PROCESS_EXIT)
        finally:
            reap(proc)
    assert proc.returncode == 0, err.decode(errors="replace")
    assert sorted(server.ids()) == ["env-1", "env-2"]


@pytest.mark.parametrize(
    ("secret", "said"),
    [
        ("whsec_not*base64!", "not valid base64"),
        ("whsec_c2hvcnQ=", "shorter than 16 bytes"),
        ("   ", "not valid base64|shorter than 16 bytes"),
    ],
)
def test_a_bad_secret_is_refused_at_start_without_echoing_it(secret: str, said: str) -> None:
    env = {
        "OUTBOX_DESTINATION_BILLING_URL": "http://b.example",
        "OUTBOX_DESTINATION_BILLING_SECRET": secret,
    }
    with pytest.raises(ConfigError, match=said) as refused:
        destinations_from({}, None, env)
    assert "OUTBOX_DESTINATION_BILLING_*" in str(refused.value)
    if secret.strip():
        assert secret.removeprefix("whsec_") not in str(refused.value)


def test_unsigned_delivery_only_when_the_config_says_so() -> None:
    with pytest.raises(ConfigError, match=r"no secret.*unsigned = true"):
        destinations_from({}, None, {"OUTBOX_DESTINATION_B_URL": "http://b.example"})
    found = destinations_from(
        {},
        None,
        {"OUTBOX_DESTINATION_B_URL": "http://b.example", "OUTBOX_DESTINATION_B_UNSIGNED": "true"},
    )
    assert (found["b"].secret, found["b"].unsigned) == (None, True)
    with pytest.raises(ConfigError, match="a secret and unsigned = true"):
        make_destination("http://b.example", secret=SECRET, unsigned=True)


def test_a_variable_that_could_set_two_destinations_is_refused() -> None:
    document = {
        "destinations": {
            "orders": {"url": "http://o.example/in", "secret_env": "K", "mode": "batch"},
            "orders_batch": {"url": "http://b.example/in", "secret_env": "K"},
        }
    }
    env = {"K": SECRET, "OUTBOX_DESTINATION_ORDERS_BATCH_URL": "http://elsewhere.example/in"}
    with pytest.raises(
        ConfigError, match=r"could set batch_url of 'orders' or url of 'orders_batch'"
    ):
        destinations_from(document, "relay.toml", env)


def test_environment_names_are_lowercase_and_may_not_shadow_a_mixed_case_table() -> None:
    document = {"destinations": {"Billing": {"url": "http://b.example/in", "secret_env": "K"}}}
    env = {"K": SECRET, "OUTBOX_DESTINATION_BILLING_TIMEOUT": "3"}
    with pytest.raises(ConfigError, match="the file has 'Billing'"):
        destinations_from(document, "relay.toml", env)


def test_a_bad_url_is_refused_without_its_credentials() -> None:
    env = {
        "OUTBOX_DESTINATION_B_URL": "ftp://user:hunter2@h.example/x?token=abc",
        "OUTBOX_DESTINATION_B_SECRET": SECRET,
    }
    with pytest.raises(ConfigError) as refused:
        destinations_from({}, None, env)
    assert "hunter2" not in str(refused.value)
    assert "token=abc" not in str(refused.value)


def test_a_secret_env_set_in_the_environment_may_name_an_outbox_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert main(["db", "upgrade", "--db", db]) == 0
    monkeypatch.setenv("OUTBOX_DESTINATION_BILLING_SECRET_ENV", "OUTBOX_BILLING_KEY")
    monkeypatch.setenv("OUTBOX_BILLING_KEY", SECRET)
    capsys.readouterr()
    assert main(["status", "--db", db]) == 0, capsys.readouterr().err


def test_broker_destinations_from_the_file_and_the_environment() -> None:
    document = {
        "destinations": {
            "events": {
                "kind": "nats",
                "url": "nats://127.0.0.1:4222",
                "stream": "ORDERS",
                "subject": "orders.{ordering_key}",
                "secret_env": "EVENTS_KEY",
            }
        }
    }
    env = {
        "EVENTS_KEY": SECRET,
        "OUTBOX_DESTINATION_AUDIT_KIND": "rabbitmq",
        "OUTBOX_DESTINATION_AUDIT_URL": "amqp://guest:guest@127.0.0.1:5672/",
        "OUTBOX_DESTINATION_AUDIT_EXCHANGE": "",
        "OUTBOX_DESTINATION_AUDIT_ROUTING_KEY": "audit",
        "OUTBOX_DESTINATION_AUDIT_SECRET": SECRET,
        "OUTBOX_DESTINATION_AUDIT_ALLOW_SHORT_RETENTION": "true",
    }
    # An empty variable is refused (set but empty), so the default exchange comes from TOML.
    env.pop("OUTBOX_DESTINATION_AUDIT_EXCHANGE")
    document["destinations"]["audit"] = {"exchange": ""}
    found = destinations_from(document, "relay.toml", env)
    assert found["events"] == make_destination(
        "nats://127.0.0.1:4222",
        secret=SECRET,
        kind="nats",
        stream="ORDERS",
        subject="orders.{ordering_key}",
    )
    assert found["audit"] == make_destination(
        "amqp://guest:guest@127.0.0.1:5672/",
        secret=SECRET,
        kind="rabbitmq",
        exchange="",
        routing_key="audit",
        allow_short_retention=True,
    )


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ({"kind": "nats", "url": "http://h/", "stream": "S", "subject": "s"}, "nats|tls://"),
        ({"kind": "nats", "url": "nats://h", "subject": "s"}, "kind nats needs stream"),
        ({"kind": "rabbitmq", "url": "amqp://h", "exchange": "x"}, "needs routing_key"),
        (
            {"kind": "nats", "url": "nats://h", "stream": "S", "subject": "s.{tenant}"},
            r"names \['tenant'\]; only \{ordering_key\} is known",
        ),
        ({"kind": "nats", "url": "nats://h", "stream": "S", "subject": "s.{"}, "subject 's.{'"),
        (
            {"kind": "nats", "url": "nats://h", "stream": "S", "subject": "s.a b"},
            "must not hold spaces, tabs or line breaks",
        ),
        (
            {"kind": "nats", "url": "nats://h", "stream": "S", "subject": "s\r\nPUB x 0"},
            "must not hold spaces, tabs or line breaks",
        ),
        (
            {"kind": "nats", "url": "nats://h", "stream": "ORDERS.EU", "subject": "s"},
            "stream 'ORDERS.EU' is not a JetStream stream name",
        ),
        (
            # Go would write its PubAcks' stream as "\x01S", which no JSON reader takes.
            {"kind": "nats", "url": "nats://h", "stream": "\x01S", "subject": "s"},
            "is not a JetStream stream name",
        ),
        ({"kind": "nats", "url": "nats://h", "stream": "", "subject": "s"}, "stream ''"),
        (
            {"kind": "nats", "url": "nats://h", "stream": "S", "subject": "s", "mode": "batch"},
            "mode is a key of http destinations, not of nats",
        ),
        (
            {"url": "http://h/", "stream": "S"},
            "stream is a key of nats destinations, not of http",
        ),
        (
            {
                "kind": "rabbitmq",
                "url": "amqp://h",
                "exchange": "",
                "routing_key": "k",
                "subject": "s",
            },
            "subject is a key of nats destinations, not of rabbitmq",
        ),
    ],
)
def test_broker_keys_are_checked_for_their_kind(table: dict[str, object], said: str) -> None:
    document = {"destinations": {"events": {**table, "unsigned": True}}}
    with pytest.raises(ConfigError, match=said):
        destinations_from(document, "relay.toml", {})


def test_a_nats_destination_uses_the_fast_client_unless_it_says_not_to() -> None:
    table = {"kind": "nats", "url": "nats://h", "stream": "S", "subject": "s", "unsigned": True}
    document = {"destinations": {"events": table, "slow": {**table, "fast_client": False}}}
    env = {
        "OUTBOX_DESTINATION_SLOW_FAST_CLIENT": "true",
        "OUTBOX_DESTINATION_EVENTS_FAST_CLIENT": "no",
    }
    found = destinations_from(document, "relay.toml", {})
    assert (found["events"].options, found["slow"].options) == (
        NatsOptions("S", "s", fast_client=True),
        NatsOptions("S", "s", fast_client=False),
    )
    found = destinations_from(document, "relay.toml", env)
    assert [found[name].options.fast_client for name in ("events", "slow")] == [False, True]
    with pytest.raises(ConfigError, match="fast_client is a key of nats destinations, not of http"):
        destinations_from(
            {"destinations": {"b": {"url": "http://b/", "fast_client": False}}}, None, {}
        )


def test_a_nats_key_is_refused_on_an_http_destination_even_at_its_default() -> None:
    with pytest.raises(ConfigError, match="fast_client is a key of nats destinations, not of http"):
        make_destination("https://hooks.example/in", unsigned=True, fast_client=True)


def test_an_http_option_at_its_default_is_still_tolerated_elsewhere() -> None:
    made = make_destination(
        "nats://127.0.0.1:4222", kind="nats", stream="S", subject="s", unsigned=True, mode="single"
    )
    assert made.kind == "nats"


def test_a_bad_url_is_named_before_a_missing_key_of_the_kind() -> None:
    with pytest.raises(ConfigError, match=r"destination url of kind nats must be nats\|tls://host"):
        make_destination("http://not-nats:4222", kind="nats", stream="S", unsigned=True)
