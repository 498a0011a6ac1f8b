"""The worker supervisor's shutdown: bounded, forced by a second signal, honest about failures."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import supervised_workers
from support.processes import PROCESS_EXIT
from support.receiver_helpers import ROOT, wait_until

from outbox_cli import processes

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    """A listening loopback socket for the workers to hold."""
    listening = processes.bind("127.0.0.1", 0)
    yield listening
    listening.close()


def _signal_self_when(events: list[threading.Event], sigs: list[signal.Signals]) -> None:
    """Send this process each signal in turn, once its event is set; give up on a timeout."""
    for event, sig in zip(events, sigs, strict=True):
        if not event.wait(30):
            return  # never SIGTERM the test process once its handlers may be gone
        os.kill(os.getpid(), sig)


def test_a_second_stop_signal_kills_workers_that_do_not_stop(
    sock: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    ready, asked = SPAWN.Event(), SPAWN.Event()
    sender = threading.Thread(
        target=_signal_self_when, args=([ready, asked], [signal.SIGTERM, signal.SIGINT])
    )
    sender.start()
    try:
        # A grace far longer than the test may take: only the second signal can end it.
        status = processes.serve_in_processes(
            1, supervised_workers.stubborn, sock, (ready, asked), grace=600
        )
    finally:
        sender.join()
    assert asked.is_set()
    assert status == 1
    assert "still running after another stop signal: killing it" in caplog.text


def test_workers_that_outlast_the_grace_are_killed(
    sock: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    ready, asked = SPAWN.Event(), SPAWN.Event()
    sender = threading.Thread(target=_signal_self_when, args=([ready], [signal.SIGTERM]))
    sender.start()
    try:
        status = processes.serve_in_processes(
            1, supervised_workers.stubborn, sock, (ready, asked), grace=0.5
        )
    finally:
        sender.join()
    assert status == 1
    assert "still running after 0.5s passed: killing it" in caplog.text


def test_a_worker_failing_as_the_stop_signal_comes_fails_the_service(
    sock: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    status = processes.serve_in_processes(
        1, supervised_workers.stops_the_service_and_fails, sock, None
    )
    assert status == 1


def test_the_fallback_watch_ends_a_process_whose_parent_was_killed() -> None:
    watcher = (
        "import os, signal\n"
        "from outbox_cli import processes\n"
        "processes.watch_parent_in_thread(os.getppid())\n"
        "print('watching', flush=True)\n"
        "signal.pause()\n"
    )
    parent_code = (
        "import signal, subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {watcher!r}])\n"
        "print(child.pid, flush=True)\n"
        "signal.pause()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        lines = {parent.stdout.readline().strip(), parent.stdout.readline().strip()}
        assert "watching" in lines
        (child,) = (int(line) for line in lines if line != "watching")
        parent.kill()
        parent.wait(timeout=PROCESS_EXIT)
        wait_until(lambda: _gone(child), PROCESS_EXIT, "the orphaned watcher to end")
    finally:
        parent.kill()
        parent.communicate(timeout=PROCESS_EXIT)


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
