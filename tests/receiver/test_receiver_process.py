"""The receiver as a real process: the lost ACK, serving over uvicorn, worker processes, and
the CLI."""

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
from support.processes import PROCESS_EXIT, PROCESS_START
from support.receiver_helpers import (
    OTHER_SECRET,
    ROOT,
    SECRET,
    ReceiverProcess,
    count_effects,
    signed,
    stored_receipts,
    wait_until,
)

from outbox import failpoints
from outbox.signing import sign
from outbox.testing import ManualClock
from outbox_cli import main, processes
from outbox_cli.receiver import load_secrets, parse_duration
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
    crashing = ReceiverProcess(db_url, secret_file, failpoints.environment("receiver.after_commit"))
    try:
        crashing.wait_ready()
        with pytest.raises(httpx.TransportError):
            httpx.post(
                crashing.base + "/replies",
                content=BODY,
                headers=signed("reply:t-9", BODY),
                timeout=10,
            )
        assert crashing.proc.wait(timeout=PROCESS_EXIT) == failpoints.EXIT_CODE
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
        [sys.executable, "-m", "outbox_cli", "receiver", "--db", db_url, "--port", "1"],
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


def _workers_of(served: ReceiverProcess) -> list[int]:
    """Pids of the worker processes `outbox receiver --workers N` started (not its tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # ended while being listed
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == served.proc.pid and b"spawn_main" in argv:
            pids.append(int(entry.name))
    return pids


def _wait_for_two_workers(served: ReceiverProcess, workers: list[int]) -> None:
    """Fill `workers` with the pids of `--workers 2` once both are running."""

    def both_started() -> bool:
        workers[:] = _workers_of(served)
        return len(workers) == 2

    wait_until(both_started, PROCESS_START, "two worker processes")


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_workers_share_one_port_each_answers_and_sigterm_stops_them_all(
    db_url: str, secret_file: Path
) -> None:
    served = ReceiverProcess(db_url, secret_file, options=["--workers", "2"]).wait_ready()
    try:
        workers: list[int] = []
        _wait_for_two_workers(served, workers)
        # With the other worker stopped, only this one can take the connection: an answer
        # is then this one's.
        for index, worker in enumerate(workers):
            others = [pid for pid in workers if pid != worker]
            for pid in others:
                os.kill(pid, signal.SIGSTOP)
            try:
                body = b'{"worker":%d}' % index
                answer = httpx.post(
                    served.base + "/replies",
                    content=body,
                    headers=signed(f"w-{index}", body),
                    # Spawned is not yet serving: this worker may still be starting.
                    timeout=PROCESS_START,
                )
            finally:
                for pid in others:
                    os.kill(pid, signal.SIGCONT)
            assert answer.status_code == 200, answer.text
        assert stored_receipts(db_url) == {"w-0": b'{"worker":0}', "w-1": b'{"worker":1}'}
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=PROCESS_EXIT) == 0
        assert all(_gone(pid) for pid in workers)
    finally:
        served.stop()


def test_a_worker_that_dies_ends_the_service(db_url: str, secret_file: Path) -> None:
    served = ReceiverProcess(db_url, secret_file, options=["--workers", "2"]).wait_ready()
    try:
        workers: list[int] = []
        _wait_for_two_workers(served, workers)
        os.kill(workers[0], signal.SIGKILL)
        # Not left running one short: the other is stopped too, and the exit says so.
        assert served.proc.wait(timeout=PROCESS_EXIT) == 1
        assert all(_gone(pid) for pid in workers)
        _, err = served.proc.communicate(timeout=PROCESS_EXIT)
        assert f"worker {workers[0]} ended".encode() in err
    finally:
        served.stop()


def _port_free(port: int) -> bool:
    """Whether a restarted receiver could bind the port now."""
    try:
        processes.bind("127.0.0.1", port).close()
    except OSError:
        return False
    return True


def test_workers_end_when_their_parent_is_killed(db_url: str, secret_file: Path) -> None:
    served = ReceiverProcess(db_url, secret_file, options=["--workers", "2"]).wait_ready()
    try:
        workers: list[int] = []
        _wait_for_two_workers(served, workers)
        # No cleanup runs in the parent: only the workers themselves can let go of the port.
        served.proc.kill()
        served.proc.wait(timeout=PROCESS_EXIT)
        wait_until(
            lambda: all(_gone(pid) for pid in workers), PROCESS_EXIT, "the orphaned workers to end"
        )
        wait_until(lambda: _port_free(served.port), PROCESS_EXIT, "the port to be free")
    finally:
        # Workers left behind would hold the output pipes open and stop() would never return.
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        served.stop()


@pytest.mark.parametrize("workers", ["0", "-1", "two", "1.5"])
def test_workers_must_be_a_whole_number_of_at_least_one(
    workers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["receiver", "--db", "sqlite://", "--workers", workers])
    assert exited.value.code == 2
    assert f"expected a whole number >= 1, got {workers!r}" in capsys.readouterr().err
