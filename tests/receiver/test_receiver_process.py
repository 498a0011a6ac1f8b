"""The receiver as a real process: the lost ACK, serving over uvicorn, and the CLI."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.receiver_helpers import (
    OTHER_SECRET,
    ROOT,
    SECRET,
    ReceiverProcess,
    count_effects,
    signed,
    stored_receipts,
)

from outbox import failpoints
from outbox.cli import main
from outbox.cli.receiver import load_secrets, parse_duration
from outbox.signing import sign
from outbox.testing import ManualClock
from receiver import ReceiptStore
from receiver.effects import record_effect
from receiver.rules import RETENTION_HEADER

BODY = b'{"kind":"result","task_id":"t-9","status":"done","result":{"ok":true}}'
DAY = 86_400.0


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A secrets file with a comment, a blank line and the test secret."""
    path = tmp_path / "secrets"
    path.write_text(f"# current\n\n{SECRET}\n", encoding="utf-8")
    path.chmod(0o600)
    return path


def test_lost_ack_then_resend_is_a_duplicate(db_url: str, secret_file: Path) -> None:
    crashing = ReceiverProcess(db_url, secret_file, {failpoints.ENV_VAR: "receiver.after_commit"})
    try:
        crashing.wait_ready()
        with pytest.raises(httpx.TransportError):
            httpx.post(
                crashing.base + "/replies",
                content=BODY,
                headers=signed("reply:t-9", BODY),
                timeout=10,
            )
        assert crashing.proc.wait(timeout=10) == failpoints.EXIT_CODE
    finally:
        crashing.stop()
    # Committed before the crash: the receipt and exactly one effect exist, no ACK was sent.
    assert stored_receipts(db_url) == {"reply:t-9": BODY}
    assert count_effects(db_url, "reply:t-9") == 1

    healthy = ReceiverProcess(db_url, secret_file).wait_ready()
    try:
        resend = httpx.post(
            healthy.base + "/replies", content=BODY, headers=signed("reply:t-9", BODY), timeout=10
        )
        assert resend.status_code == 200
        assert resend.json() == {"ack": "stored", "reply_id": "reply:t-9", "duplicate": True}
        assert resend.headers[RETENTION_HEADER] == str(30 * 86_400)
        lookup = httpx.get(
            healthy.base + "/replies/reply:t-9",
            headers=sign(SECRET, "reply:t-9", None, b""),
            timeout=10,
        )
        assert lookup.status_code == 200
    finally:
        # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit tells why it stopped.
        assert healthy.stop() in (0, -signal.SIGTERM)
    assert count_effects(db_url, "reply:t-9") == 1


def refused_upload(base: str, content: object, headers: dict[str, str]) -> int:
    """POST a body the server must refuse; its status, or 413 when it hung up mid-upload.

    A server that answers 413 before reading the whole body may close the socket
    while the client is still sending: the client then sees a reset, not the answer.
    Either way the body was refused before it was buffered.
    """
    try:
        return httpx.post(
            base + "/replies",
            content=content,  # type: ignore[arg-type]
            headers=headers,
            timeout=10,
        ).status_code
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        return 413


def test_served_limits_hold_over_real_http(db_url: str, secret_file: Path) -> None:
    served = ReceiverProcess(db_url, secret_file).wait_ready()
    try:
        big = b"[" + b"1," * 600_000 + b"1]"
        assert refused_upload(served.base, big, signed("r-big", big)) == 413

        def chunks() -> object:
            for _ in range(1100):
                yield b" " * 1024

        assert refused_upload(served.base, chunks(), signed("r-chunk", BODY)) == 413
        # A Content-Length that claims more than the limit is refused before any body is read.
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            sock.sendall(
                b"POST /replies HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 999999999\r\n\r\n{}"
            )
            assert sock.recv(100).startswith(b"HTTP/1.1 413")
        assert count_effects(db_url) == 0
    finally:
        served.stop()


def test_serve_refuses_to_start_without_secrets(db_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_RECEIVER_SECRETS"}
    result = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "receiver", "--db", db_url, "--port", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert b"no webhook secret" in result.stderr


def test_secrets_from_file_or_environment(
    secret_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_secrets(str(secret_file)) == [SECRET]
    monkeypatch.setenv("OUTBOX_RECEIVER_SECRETS", f" {SECRET}, {OTHER_SECRET} ,")
    assert load_secrets(None) == [SECRET, OTHER_SECRET]
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no webhook secret"):
        load_secrets(str(empty))


@pytest.mark.parametrize(
    ("text", "seconds"), [("30d", 30 * DAY), ("12h", 43_200), ("90m", 5400), ("45s", 45), ("7", 7)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0d", "-1d", "1w", "1.5h", "d", "30 days"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_purge_command(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    clock = ManualClock(1_000_000.0)
    with ReceiptStore(db_url, clock=clock) as store:
        store.accept("ancient", b"{}", record_effect)
    # The CLI uses the database clock: the manual start lies decades in the past.
    assert main(["receiver", "purge", "--db", db_url, "--older-than", "7d"]) == 2
    assert "retention" in capsys.readouterr().err
    assert stored_receipts(db_url) == {"ancient": b"{}"}
    assert main(["receiver", "--db", db_url, "purge", "--older-than", "30d"]) == 0
    assert "purged 1 receipt" in capsys.readouterr().out
    assert stored_receipts(db_url) == {}
    shorter = ["receiver", "purge", "--db", db_url, "--older-than", "7d", "--retention", "7d"]
    assert main(shorter) == 0
    assert "purged 0 receipt" in capsys.readouterr().out


def test_upgrade_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert main(["receiver", "purge", "--db", url, "--older-than", "30d"]) == 2
    assert "outbox receiver upgrade" in capsys.readouterr().err
    assert main(["receiver", "upgrade", "--db", url]) == 0
    assert main(["receiver", "purge", "--db", url, "--older-than", "30d"]) == 0
    assert "purged 0" in capsys.readouterr().out
