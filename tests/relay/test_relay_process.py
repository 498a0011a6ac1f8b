"""`outbox relay` as a real process: SIGTERM drain, metrics and health, crashes at failpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from support.processes import PROCESS_EXIT, PROCESS_START, reap
from support.receiver_helpers import ROOT, free_port, wait_until
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

from outbox import failpoints
from outbox.testing import ManualClock
from relay import Relay, make_destination

RELAY_POINTS = [
    "relay.after_claim",
    "relay.after_remote_commit",
    "relay.before_sent_commit",
    "relay.after_sent_commit",
]


def write_config(tmp_path: Path, server: ScriptedServer, **relay: object) -> Path:
    """A relay TOML file for the scripted server."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n", encoding="utf-8")
    settings = {"lease": 10, "poll_interval": 0.05, **relay}
    lines = ["[relay]"] + [f"{key} = {value!r}" for key, value in settings.items()]
    lines += [
        "[destinations.default]",
        f'url = "{server.url}"',
        f'secret_file = "{secret}"',
        "timeout = 5",
    ]
    path = tmp_path / "relay.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def start_relay(
    db_url: str, config: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`outbox relay` in a child process."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbox_cli",
            "relay",
            "--db",
            db_url,
            "--config",
            str(config),
            *list(extra),
        ],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen[bytes], timeout: float = PROCESS_EXIT) -> tuple[int, str]:
    """Wait for the child; returns its exit status and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err.decode(errors="replace")


def test_sigterm_finishes_in_flight_work_and_exits_zero(
    db_url: str, engine: sa.Engine, server: ScriptedServer, tmp_path: Path
) -> None:
    publish_many(engine, ["t-1"])
    server.script("t-1", Answer(stall=1.0))
    proc = start_relay(db_url, write_config(tmp_path, server))
    try:
        wait_until(lambda: server.ids() == ["t-1"], PROCESS_START, "the delivery to start")
        proc.send_signal(signal.SIGTERM)
        status, err = finish(proc)
    finally:
        reap(proc)
    assert status == 0, err
    assert rows(engine)["t-1"]["state"] == "sent"  # drained, not abandoned


def test_metrics_and_health_are_served(
    db_url: str, engine: sa.Engine, server: ScriptedServer, tmp_path: Path
) -> None:
    port = free_port()
    proc = start_relay(
        db_url, write_config(tmp_path, server), "--metrics-port", str(port), "--log-format", "json"
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            try:
                return httpx.get(base + "/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, PROCESS_START, "the relay health check")
        publish_many(engine, ["m-1", "m-2"])
        wait_until(lambda: sorted(server.ids()) == ["m-1", "m-2"], 20, "two deliveries")
        wait_until(
            lambda: (
                'outbox_relay_outcomes_total{destination="default",outcome="sent",status="200"}'
                " 2.0" in httpx.get(base + "/metrics", timeout=5).text
            ),
            20,
            "the sent counter",
        )
        # The database gauges are read at most once a second: poll until they catch up.
        wait_until(
            lambda: (
                'outbox_relay_backlog{destination="default"} 0.0'
                in httpx.get(base + "/metrics", timeout=5).text
            ),
            20,
            "the backlog gauge to read 0",
        )
        text = httpx.get(base + "/metrics", timeout=5).text
        assert "outbox_relay_database_up 1.0" in text
        assert "outbox_relay_delivery_seconds_count" in text
        ready = httpx.get(base + "/readyz", timeout=5)
        assert (ready.status_code, ready.json()["database"]) == (200, True)
        assert httpx.get(base + "/nothing", timeout=5).status_code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        status, err = finish(proc)
        reap(proc)
    assert status == 0, err


# A crash proof: with the fault proofs (`make test-faults`), out of the default suite's time.
@pytest.mark.faults
@pytest.mark.parametrize("point", RELAY_POINTS)
def test_a_relay_killed_at_a_failpoint_loses_nothing(
    point: str, db_url: str, engine: sa.Engine, server: ScriptedServer, tmp_path: Path
) -> None:
    publish_many(engine, ["f-1"])
    proc = start_relay(db_url, write_config(tmp_path, server), env=failpoints.environment(point))
    status, err = finish(proc)
    assert status == failpoints.EXIT_CODE, err
    state = rows(engine)["f-1"]["state"]
    assert state == ("sent" if point == "relay.after_sent_commit" else "sending")
    # A survivor whose clock is past the dead relay's lease takes over and finishes.
    later = ManualClock(time.time() + 60)
    survivor = Relay(
        db_url, {"default": make_destination(server.url, secret=SECRET, timeout=5)}, clock=later
    )
    with survivor:
        survivor.dispatch_once()
    assert rows(engine)["f-1"]["state"] == "sent"
    # Window B (died before sending): one send. Window C (the peer has it, the outcome was
    # never recorded): sent again. Window D (sent was committed): nothing more to do.
    sends = {"relay.after_claim": 1, "relay.after_sent_commit": 1}.get(point, 2)
    assert len(server.ids()) == sends


def json_lines(err: str) -> list[dict[str, object]]:
    """Every stderr line as JSON (fails on a line that is not one JSON object)."""
    lines = err.splitlines()
    assert lines, "nothing logged"
    parsed = [json.loads(line) for line in lines]
    assert all(isinstance(entry, dict) for entry in parsed), lines
    return parsed


def test_json_logs_are_one_object_per_line_with_the_dead_reply_and_turn_summary(
    db_url: str, engine: sa.Engine, server: ScriptedServer, tmp_path: Path
) -> None:
    publish_many(engine, ["j-ok", "j-gone"])
    server.script("j-gone", Answer(status=410))
    config = write_config(tmp_path, server, owner="r-json")
    proc = start_relay(db_url, config, "--log-format", "json")
    try:
        wait_until(
            lambda: rows(engine)["j-gone"]["state"] == "dead",
            PROCESS_START,
            "the relay to start and record the dead reply",
        )
        wait_until(lambda: rows(engine)["j-ok"]["state"] == "sent", 20, "the sent reply")
    finally:
        proc.send_signal(signal.SIGTERM)
        status, err = finish(proc)
    assert status == 0, err
    logged = json_lines(err)
    [dead] = [e for e in logged if e["level"] == "warning" and "reply_id" in e]
    assert (dead["reply_id"], dead["destination"], dead["status"]) == ("j-gone", "default", 410)
    assert str(dead["reason"]).startswith("HTTP 410")
    turns = [entry for entry in logged if str(entry["message"]).startswith("turn for default")]
    assert sum(int(turn["claimed"]) for turn in turns) == 2  # type: ignore[call-overload]
    assert {key for turn in turns for key in turn} >= {"claimed", "sent", "retry", "dead"}
    messages = [entry["message"] for entry in logged]
    assert "relay r-json started" in messages
    assert messages[-1] == "relay r-json stopped"


def test_a_relay_that_cannot_reach_its_database_says_so_in_one_json_line(
    server: ScriptedServer, tmp_path: Path
) -> None:
    closed = f"postgresql://postgres:pw@127.0.0.1:{free_port()}/nothing"
    proc = start_relay(closed, write_config(tmp_path, server), "--log-format", "json")
    status, err = finish(proc, timeout=120)  # it exits on its own: a busy machine only delays it
    assert status == 3, err
    logged = json_lines(err)
    errors = [entry for entry in logged if entry["level"] == "error"]
    assert len(errors) == 1, logged
    shown = closed.replace(":pw@", ":<redacted>@")
    assert str(errors[0]["message"]).startswith(f"outbox: error: database {shown}: "), errors
    assert "Connection refused" in str(errors[0]["message"])
    assert ":pw@" not in err
