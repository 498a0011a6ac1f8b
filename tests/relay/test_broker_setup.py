"""`outbox broker setup` against the real NATS and RabbitMQ: what it creates lets the relay
start and deliver, a second run changes nothing, what is too small is raised, what
conflicts is refused, and a dry run touches nothing.

Every stream, exchange and queue is the test's own (unique names), deleted after.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from support.nats_helpers import NATS_URL, Stream, new_stream, require_nats, with_jetstream
from support.rabbitmq import (
    AMQP_URL,
    delete_topology,
    exchange_exists,
    reachable,
    take_all,
    topology,
    unique,
)
from support.relay_helpers import publish_many

from outbox_cli import main
from relay import ConfigError, Relay
from relay.broker_setup import Change, binding_key, covers, stream_subject
from relay.config import load_destinations
from relay.errors import SetupRefused
from relay.nats_setup import stream_changes, update_stream_as_served
from relay.policy import retry_window

sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@pytest.mark.parametrize(
    ("template", "subject"),
    [
        ("orders.{ordering_key}", "orders.*"),
        ("{ordering_key}.orders", "*.orders"),
        ("orders.v{ordering_key}.created", "orders.*.created"),
        ("orders.created", "orders.created"),
        ("{{literal}}.{ordering_key}", "{literal}.*"),
    ],
)
def test_a_subject_template_becomes_the_stream_subject_that_captures_it(
    template: str, subject: str
) -> None:
    assert stream_subject(template) == subject


@pytest.mark.parametrize(
    ("template", "key"),
    [
        ("orders.{ordering_key}", "orders.#"),
        ("{ordering_key}.orders", "#.orders"),
        ("orders.created", "orders.created"),
    ],
)
def test_a_routing_key_template_becomes_a_binding_key_for_dotted_keys_too(
    template: str, key: str
) -> None:
    assert binding_key(template) == key


@pytest.mark.parametrize(
    ("have", "wanted", "captured"),
    [
        ("orders.>", "orders.*", True),
        ("orders.*", "orders.*", True),
        ("orders.*", "orders.x", True),
        ("orders._", "orders.*", False),
        ("orders.*", "orders.>", False),
        ("orders.*", "orders.*.v1", False),
        (">", "anything.*", True),
        ("*.orders", "x.orders", True),
    ],
)
def test_a_stream_filter_covers_a_wanted_filter_as_nats_would(
    have: str, wanted: str, captured: bool
) -> None:
    assert covers(have, wanted) is captured


def test_allow_short_retention_keeps_a_window_that_max_age_holds_down() -> None:
    from nats.js.api import StreamConfig

    config = StreamConfig(name="S", subjects=["a.*"], duplicate_window=60, max_age=100)
    with pytest.raises(SetupRefused, match="raise its max_age"):
        stream_changes(config, "a.*", 720, allow_short=False)
    changes, said = stream_changes(config, "a.*", 720, allow_short=True)
    assert changes == {}
    assert said == ["duplicate window 60s kept: allow_short_retention is set"]
    changes, _ = stream_changes(config, "b.*", 90, allow_short=False)
    assert changes == {"subjects": ["a.*", "b.*"], "duplicate_window": 90}


class ServedStream:
    """A NATS client stand-in: answers STREAM.INFO with `config` and records the requests."""

    def __init__(self, config: dict[str, Any], update_answer: dict[str, Any]) -> None:
        self.config = config
        self.update_answer = update_answer
        self.sent: list[tuple[str, bytes]] = []

    async def request(self, subject: str, data: bytes, timeout: float) -> SimpleNamespace:
        self.sent.append((subject, data))
        answer = {"config": self.config} if ".INFO." in subject else self.update_answer
        return SimpleNamespace(data=json.dumps(answer).encode())


def test_an_update_sends_back_every_field_the_server_served() -> None:
    # A field nats-py does not know (a newer server's) is kept, not reset to its default.
    served = {"name": "S", "subjects": ["a.>"], "duplicate_window": 120_000_000_000}
    client = ServedStream({**served, "future_field": {"kept": True}}, {"config": {}})
    asyncio.run(update_stream_as_served(client, "S", {"duplicate_window": 900}, 2.0))
    subject, data = client.sent[-1]
    assert subject == "$JS.API.STREAM.UPDATE.S"
    assert json.loads(data) == {
        **served,
        "duplicate_window": 900_000_000_000,
        "future_field": {"kept": True},
    }


def test_a_refused_update_is_nats_pys_api_error() -> None:
    import nats.js.errors

    refusal = {"error": {"code": 400, "err_code": 10065, "description": "subjects overlap"}}
    client = ServedStream({"name": "S", "subjects": []}, refusal)
    with pytest.raises(nats.js.errors.APIError) as refused:
        asyncio.run(update_stream_as_served(client, "S", {"subjects": ["b.>"]}, 2.0))
    assert (refused.value.err_code, refused.value.description) == (10065, "subjects overlap")


def test_a_dry_run_says_what_would_change_and_no_more() -> None:
    assert (
        Change("NATS stream S", "created", "x").line(True) == "NATS stream S: would be created (x)"
    )
    assert Change("NATS stream S", "unchanged").line(True) == "NATS stream S: unchanged"


# --- NATS ------------------------------------------------------------------------------


def nats_config(tmp_path: Path, stream: Stream, relay: str = "") -> Path:
    """A relay config with one NATS destination `orders` into `stream`."""
    path = tmp_path / "relay.toml"
    path.write_text(
        f"{relay}\n[destinations.orders]\nkind = 'nats'\nurl = '{NATS_URL}'\n"
        f"stream = '{stream.name}'\nsubject = '{stream.prefix}.{{ordering_key}}'\n"
        "unsigned = true\ntimeout = 5\n",
        encoding="utf-8",
    )
    return path


def setup(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    """Run `outbox broker setup ARGV`: exit status, stdout lines, stderr."""
    status = main(["broker", "setup", *argv])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def stream_config(stream: Stream) -> Any:
    """The stream's configuration as the server holds it."""

    async def read(js: Any) -> Any:
        return (await js.stream_info(stream.name)).config

    return with_jetstream(stream.url, read)


def stream_missing(stream: Stream) -> bool:
    """Whether the server has no stream of this name."""
    import nats.js.errors

    try:
        stream_config(stream)
    except nats.js.errors.NotFoundError:
        return True
    return False


@pytest.fixture
def absent_stream() -> Iterator[Stream]:
    """A stream name of this test's own, not created; deleted after if something made it."""
    require_nats()
    stream = new_stream()
    yield stream
    if not stream_missing(stream):
        stream.delete()


def window_of(db_url: str, path: Path) -> float:
    """The retry window a relay with default settings requires of destination `orders`."""
    with Relay(db_url, load_destinations(path, {})) as relay:
        return retry_window(relay.max_attempts, relay.backoff, relay.backoff_cap, relay.lease)(
            relay.destinations["orders"]
        )


def start_check(db_url: str, path: Path, **settings: Any) -> None:
    """The relay's own start check on this config (ConfigError when it would refuse)."""
    with Relay(db_url, load_destinations(path, {}), **settings) as relay:
        relay._loop.run_until_complete(relay.check_retention())


@sqlite_only
def test_setup_creates_a_stream_the_relay_starts_on_and_delivers_through(
    db_url: str, engine: sa.Engine, tmp_path: Path, absent_stream: Stream, capsys: Any
) -> None:
    path = nats_config(tmp_path, absent_stream)
    with pytest.raises(ConfigError, match=r"does not exist.*`outbox broker setup`"):
        start_check(db_url, path)

    status, lines, err = setup(capsys, "--config", str(path))

    assert (status, err) == (0, "")
    needed = window_of(db_url, path)
    assert lines == [
        f"orders: NATS stream {absent_stream.name}: created (subjects "
        f"{absent_stream.prefix}.*, duplicate window {needed:g}s)"
    ]
    assert stream_config(absent_stream).duplicate_window == needed
    start_check(db_url, path)
    publish_many(engine, ["setup-1"], destination="orders", ordering_key="customer.7")
    with Relay(db_url, load_destinations(path, {})) as relay:
        assert relay.dispatch_once() == [("setup-1", "sent")]
    [stored] = absent_stream.stored()
    assert stored.subject == f"{absent_stream.prefix}.customer%2E7"

    status, again, err = setup(capsys, "--config", str(path))
    assert (status, err) == (0, "")
    assert again == [
        f"orders: NATS stream {absent_stream.name}: unchanged (subjects "
        f"{absent_stream.prefix}.*, duplicate window {needed:g}s)"
    ]


@sqlite_only
def test_the_window_follows_the_relays_settings_from_file_environment_and_flags(
    db_url: str, tmp_path: Path, absent_stream: Stream, capsys: Any, monkeypatch: Any
) -> None:
    path = nats_config(tmp_path, absent_stream, relay="[relay]\nbackoff_cap = 10")
    monkeypatch.setenv("OUTBOX_RELAY_MAX_ATTEMPTS", "5")

    status, _, err = setup(capsys, "--config", str(path), "--lease", "20")

    assert (status, err) == (0, "")
    destination = load_destinations(path, {})["orders"]
    needed = retry_window(5, 2, 10, 20)(destination)
    assert stream_config(absent_stream).duplicate_window == needed
    start_check(db_url, path, max_attempts=5, backoff_cap=10, lease=20)
    # A relay that retries for longer than the stream remembers is refused at start.
    with pytest.raises(ConfigError, match="shorter than the longest retry window"):
        start_check(db_url, path, max_attempts=6, backoff_cap=10, lease=20)


@sqlite_only
def test_a_short_duplicate_window_is_raised_and_a_dry_run_leaves_it(
    db_url: str, tmp_path: Path, absent_stream: Stream, capsys: Any
) -> None:
    stream = absent_stream
    stream.duplicate_window = 60
    stream.create()
    path = nats_config(tmp_path, stream)
    with pytest.raises(
        ConfigError, match=r"duplicate window of 1m.*at least \S+ \(`outbox broker setup`"
    ):
        start_check(db_url, path)

    needed = window_of(db_url, path)
    change = f"duplicate window 60s -> {needed:g}s"

    status, lines, _ = setup(capsys, "--config", str(path), "--dry-run")
    assert status == 0
    assert lines == [f"orders: NATS stream {stream.name}: would be updated ({change})"]
    assert stream_config(stream).duplicate_window == 60

    status, lines, _ = setup(capsys, "--config", str(path))
    assert status == 0
    assert lines == [f"orders: NATS stream {stream.name}: updated ({change})"]
    assert stream_config(stream).duplicate_window == needed
    assert stream_config(stream).subjects == [f"{stream.prefix}.>"]  # kept as it was
    start_check(db_url, path)


def test_a_missing_subject_is_added_and_a_narrower_one_gives_way(
    tmp_path: Path, absent_stream: Stream, capsys: Any
) -> None:
    stream = absent_stream
    with_jetstream(
        stream.url,
        lambda js: js.add_stream(
            name=stream.name,
            subjects=[f"{stream.prefix}._", "elsewhere." + stream.prefix],
            duplicate_window=3600,
        ),
    )
    path = nats_config(tmp_path, stream)

    status, lines, _ = setup(capsys, "--config", str(path))

    assert status == 0
    assert lines == [
        f"orders: NATS stream {stream.name}: updated (subject {stream.prefix}.* added in "
        f"place of {stream.prefix}._)"
    ]
    assert stream_config(stream).subjects == ["elsewhere." + stream.prefix, f"{stream.prefix}.*"]


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"no_ack": True}, "has no_ack set"),
        ({"max_age": 100, "duplicate_window": 60}, "keeps messages for 100s (max_age)"),
    ],
)
def test_a_stream_that_only_destruction_would_fit_is_refused_in_one_line(
    tmp_path: Path, absent_stream: Stream, capsys: Any, settings: dict[str, Any], refusal: str
) -> None:
    stream = absent_stream
    with_jetstream(
        stream.url,
        lambda js: js.add_stream(name=stream.name, subjects=[f"{stream.prefix}.>"], **settings),
    )
    before = stream_config(stream)

    status, lines, err = setup(capsys, "--config", str(nats_config(tmp_path, stream)))

    assert (status, lines) == (1, [])
    assert err.count("\n") == 1
    assert refusal in err
    assert stream_config(stream) == before


def test_a_subject_another_stream_captures_names_that_stream(
    tmp_path: Path, absent_stream: Stream, capsys: Any
) -> None:
    other = new_stream()
    with_jetstream(
        other.url,
        lambda js: js.add_stream(name=other.name, subjects=[f"{absent_stream.prefix}.>"]),
    )
    try:
        status, _, err = setup(capsys, "--config", str(nats_config(tmp_path, absent_stream)))
    finally:
        other.delete()
    assert status == 1
    assert err.count("\n") == 1
    assert f"stream {other.name!r} captures subjects of {absent_stream.prefix}.*" in err


def test_a_dry_run_creates_no_stream(tmp_path: Path, absent_stream: Stream, capsys: Any) -> None:
    status, lines, _ = setup(
        capsys, "--config", str(nats_config(tmp_path, absent_stream)), "--dry-run"
    )
    assert status == 0
    assert lines[0].startswith(f"orders: NATS stream {absent_stream.name}: would be created (")
    assert stream_missing(absent_stream)


def test_destinations_may_come_from_the_environment_alone(
    absent_stream: Stream, capsys: Any, monkeypatch: Any
) -> None:
    for key, value in {
        "KIND": "nats",
        "URL": NATS_URL,
        "STREAM": absent_stream.name,
        "SUBJECT": f"{absent_stream.prefix}.{{ordering_key}}",
        "UNSIGNED": "true",
    }.items():
        monkeypatch.setenv(f"OUTBOX_DESTINATION_EVENTS_{key}", value)
    monkeypatch.delenv("OUTBOX_RELAY_CONFIG", raising=False)
    monkeypatch.delenv("OUTBOX_CONFIG", raising=False)

    status, lines, _ = setup(capsys)

    assert status == 0
    assert lines[0].startswith(f"events: NATS stream {absent_stream.name}: created")
    assert not stream_missing(absent_stream)


# --- RabbitMQ --------------------------------------------------------------------------


def rabbit_config(tmp_path: Path, exchange: str) -> Path:
    """A relay config with a RabbitMQ destination `billing` and an HTTP one `hooks`."""
    path = tmp_path / "relay.toml"
    path.write_text(
        f"[destinations.billing]\nkind = 'rabbitmq'\nurl = '{AMQP_URL}'\n"
        f"exchange = '{exchange}'\nrouting_key = 'billing.{{ordering_key}}'\n"
        "unsigned = true\ntimeout = 5\n"
        "[destinations.hooks]\nurl = 'http://127.0.0.1:9/'\nunsigned = true\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture
def names() -> Iterator[tuple[str, str]]:
    """An exchange and a queue name of this test's own, deleted after if made."""
    reachable()
    made = (unique("exchange"), unique("queue"))
    yield made
    delete_topology(*made)


@sqlite_only
def test_setup_declares_an_exchange_and_queue_the_relay_delivers_into(
    db_url: str,
    engine: sa.Engine,
    tmp_path: Path,
    names: tuple[str, str],
    capsys: Any,
) -> None:
    exchange, queue = names
    path = rabbit_config(tmp_path, exchange)
    with pytest.raises(ConfigError, match=r"does not exist.*`outbox broker setup --queue Q`"):
        start_check(db_url, path)

    status, lines, err = setup(capsys, "--config", str(path), "--queue", queue)

    assert (status, err) == (0, "")
    assert lines == [
        f"billing: RabbitMQ exchange {exchange}: created (topic, durable)",
        f"billing: RabbitMQ queue {queue}: created (durable)",
        f"billing: RabbitMQ binding {exchange} -> {queue} on 'billing.#': created",
        "hooks: http destination: nothing to set up",
    ]
    start_check(db_url, path)
    # A dotted ordering key fills two words of the routing key: `billing.#` routes it.
    publish_many(engine, ["setup-r1"], destination="billing", ordering_key="customer.7")
    with Relay(db_url, {"billing": load_destinations(path, {})["billing"]}) as relay:
        assert relay.dispatch_once() == [("setup-r1", "sent")]
    [queued] = take_all(queue)
    assert (queued.message_id, queued.routing_key) == ("setup-r1", "billing.customer.7")

    status, again, _ = setup(capsys, "--config", str(path), "--queue", queue)
    assert status == 0
    assert again == [
        f"billing: RabbitMQ exchange {exchange}: unchanged (topic, durable)",
        f"billing: RabbitMQ queue {queue}: unchanged (exists; left as it is)",
        f"billing: RabbitMQ binding {exchange} -> {queue} on 'billing.#': ensured "
        "(binding again changes nothing)",
        "hooks: http destination: nothing to set up",
    ]


def test_an_exchange_of_another_type_is_refused_until_the_type_is_given(
    tmp_path: Path, capsys: Any
) -> None:
    with topology(kind="direct") as made:
        path = rabbit_config(tmp_path, made.exchange)
        status, _, err = setup(capsys, "--config", str(path), "--destination", "billing")
        assert status == 1
        assert err.count("\n") == 1
        assert "inequivalent arg 'type'" in err
        assert "--exchange-type" in err

        status, lines, _ = setup(
            capsys, "--config", str(path), "--destination", "billing", "--exchange-type", "direct"
        )
        assert status == 0
        assert lines == [f"billing: RabbitMQ exchange {made.exchange}: unchanged (direct, durable)"]


def test_a_rabbitmq_dry_run_declares_nothing(
    tmp_path: Path, names: tuple[str, str], capsys: Any
) -> None:
    exchange, queue = names
    path = rabbit_config(tmp_path, exchange)

    status, lines, _ = setup(capsys, "--config", str(path), "--queue", queue, "--dry-run")

    assert status == 0
    assert lines[:3] == [
        f"billing: RabbitMQ exchange {exchange}: would be created (topic, durable)",
        f"billing: RabbitMQ queue {queue}: would be created (durable)",
        f"billing: RabbitMQ binding {exchange} -> {queue} on 'billing.#': would be created",
    ]
    assert not exchange_exists(exchange)


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--destination", "nope"],
            "no destination 'nope'; the configured ones are billing, hooks",
        ),
        (["--binding", "x"], "--binding needs --queue"),
        (["--destination", "hooks", "--queue", "q"], "no chosen destination has one"),
        (["--queue", "q", "--exchange-type", "direct"], "matches no wildcard: give --binding"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(
    tmp_path: Path, capsys: Any, argv: list[str], said: str
) -> None:
    status, lines, err = setup(capsys, "--config", str(rabbit_config(tmp_path, "x")), *argv)
    assert (status, lines) == (2, [])
    assert err.count("\n") == 1
    assert said in err


def test_a_kind_the_relay_does_not_know_is_refused_as_the_relay_refuses_it(
    tmp_path: Path, capsys: Any
) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(
        "[destinations.logs]\nkind = 'kafka'\nurl = 'kafka://k:9092'\nunsigned = true\n",
        encoding="utf-8",
    )
    status, lines, err = setup(capsys, "--config", str(path))
    assert (status, lines) == (2, [])
    assert "destination 'logs': kind 'kafka' is not one of" in err


def test_a_relay_setting_misspelt_in_the_file_is_refused_as_the_relay_refuses_it(
    tmp_path: Path, capsys: Any
) -> None:
    path = nats_config(tmp_path, new_stream(), relay="[relay]\nbackof_cap = 10")
    status, lines, err = setup(capsys, "--config", str(path))
    assert (status, lines) == (2, [])
    assert "[relay]: unknown key `backof_cap` (did you mean `backoff_cap`?)" in err


@pytest.mark.parametrize(
    ("module", "extra"), [("nats", "nats"), ("aio_pika", "rabbitmq")], ids=["nats", "rabbitmq"]
)
def test_a_missing_client_names_its_extra(
    tmp_path: Path, capsys: Any, monkeypatch: Any, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # its import raises ImportError
    stream = new_stream()
    path = nats_config(tmp_path, stream) if extra == "nats" else rabbit_config(tmp_path, "x")
    status, _, err = setup(capsys, "--config", str(path))
    assert status == 2
    assert err == (
        f"outbox: error: a destination of kind {extra} needs the {extra} client: "
        f"pip install 'outbox-relay[{extra}]'\n"
    )


@pytest.mark.parametrize(
    ("table", "said"),
    [
        (
            "kind = 'nats'\nurl = 'nats://127.0.0.1:1'\nstream = 'S'\n"
            "subject = 'orders.{ordering_key}'",
            "cannot connect to NATS at nats://127.0.0.1:1: ",
        ),
        (
            "kind = 'rabbitmq'\nurl = 'amqp://guest:guest@127.0.0.1:1/'\nexchange = 'x'\n"
            "routing_key = 'orders.{ordering_key}'",
            "cannot connect to RabbitMQ at amqp://",
        ),
    ],
    ids=["nats", "rabbitmq"],
)
def test_an_unreachable_broker_is_one_line_and_status_1(
    tmp_path: Path, table: str, said: str
) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(
        f"[destinations.orders]\n{table}\nunsigned = true\ntimeout = 2\n", encoding="utf-8"
    )
    # A process of its own: the clients' log records would reach stderr only without the
    # test runner's log capture.
    done = subprocess.run(
        [sys.executable, "-m", "outbox_cli", "broker", "setup", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    status, lines, err = done.returncode, done.stdout.splitlines(), done.stderr
    assert (status, lines) == (1, [])
    assert err.startswith(f"outbox: error: {said}")
    assert err.count("\n") == 1
    assert "guest:guest" not in err


def test_the_default_exchange_has_nothing_to_declare(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(
        f"[destinations.jobs]\nkind = 'rabbitmq'\nurl = '{AMQP_URL}'\nexchange = ''\n"
        "routing_key = 'jobs'\nunsigned = true\n",
        encoding="utf-8",
    )
    status, lines, _ = setup(capsys, "--config", str(path))
    assert status == 0
    assert lines == [
        "jobs: RabbitMQ default exchange: nothing to set up (it delivers to the queue named 'jobs')"
    ]
    status, _, err = setup(capsys, "--config", str(path), "--queue", "jobs")
    assert status == 2
    assert "the default exchange takes no bindings" in err


def fractional_window(
    tmp_path: Path, stream: Stream
) -> tuple[dict[str, float], list[str], Path, float]:
    """Relay settings whose retry window is fractional (26.799999999999997 s), as keyword
    settings and as flags, the config file of a destination on `stream`, and that window."""
    settings = {"max_attempts": 2, "backoff": 6.6, "backoff_cap": 6.6, "lease": 5.1}
    flags = ["--max-attempts", "2", "--backoff", "6.6", "--backoff-cap", "6.6", "--lease", "5.1"]
    path = nats_config(tmp_path, stream)
    needed = retry_window(2, 6.6, 6.6, 5.1)(load_destinations(path, {})["orders"])
    return settings, flags, path, needed


@sqlite_only
def test_a_fractional_window_is_set_in_whole_seconds_the_relay_accepts(
    db_url: str, tmp_path: Path, absent_stream: Stream, capsys: Any
) -> None:
    # 2 attempts, 6.6 s backoff and cap, 5.1 s lease, 5 s timeout: 26.799999999999997 s,
    # which NATS would hand back as 26.799999999 s (whole nanoseconds, truncated).
    settings, flags, path, needed = fractional_window(tmp_path, absent_stream)
    assert needed != math.ceil(needed)

    status, lines, err = setup(capsys, "--config", str(path), *flags)

    assert (status, err) == (0, "")
    assert lines == [
        f"orders: NATS stream {absent_stream.name}: created (subjects "
        f"{absent_stream.prefix}.*, duplicate window {math.ceil(needed)}s)"
    ]
    assert stream_config(absent_stream).duplicate_window == math.ceil(needed)
    start_check(db_url, path, **settings)
    status, again, err = setup(capsys, "--config", str(path), *flags)
    assert (status, err) == (0, "")
    assert [line.split(": ")[2].split(" ")[0] for line in again] == ["unchanged"]


@sqlite_only
def test_a_window_a_nanosecond_short_from_float_conversion_still_counts(
    db_url: str, tmp_path: Path, absent_stream: Stream, capsys: Any
) -> None:
    # A stream set by hand (or by an older setup) to the exact fractional window reads back
    # truncated to whole nanoseconds; neither the relay nor setup takes that as too short,
    # so setup leaves it as it is.
    settings, flags, path, needed = fractional_window(tmp_path, absent_stream)
    absent_stream.duplicate_window = needed
    absent_stream.create()
    assert stream_config(absent_stream).duplicate_window < needed  # what the fix is for

    start_check(db_url, path, **settings)
    status, lines, err = setup(capsys, "--config", str(path), *flags)
    assert (status, err) == (0, "")
    assert [line.split(": ")[2].split(" ")[0] for line in lines] == ["unchanged"]
