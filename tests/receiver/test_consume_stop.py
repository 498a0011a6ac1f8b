"""`outbox receiver consume` stops on SIGTERM and SIGINT while its broker never answers.

The NATS client retries an unreachable server for ever when it connects, with no end
of its own: before, a signal there left the process running (10 minutes and on).
"""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from support.processes import PROCESS_EXIT, PROCESS_START, spawned
from support.receiver_helpers import ROOT, SECRET, free_port
from test_consume_crash import child_env, consume_command

import receiver
from receiver.consume import Consumer


def wait_for_line(proc: subprocess.Popen[str], wanted: str, seconds: float) -> list[str]:
    """The child's stderr lines up to the first holding `wanted`; fails after `seconds`."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=seconds)
        except queue.Empty:
            raise AssertionError(f"no {wanted!r} in {seconds} s: {seen}") from None
        if line is None:
            raise AssertionError(f"exited before {wanted!r}: {seen}")
        seen.append(line)
        if wanted in line:
            return seen


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_consumer_waiting_for_an_unreachable_nats_stops_on_a_signal(
    signum: signal.Signals, tmp_path: Path
) -> None:
    secret_file = tmp_path / "secrets"
    secret_file.write_text(SECRET + "\n")
    db_url = f"sqlite:///{tmp_path / 'receiver.db'}"
    receiver.upgrade(db_url)
    unreachable = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    command = consume_command(
        db_url, secret_file, ["--from", unreachable, "--stream", "NOWHERE", "--durable", "x"]
    )
    with spawned(command, cwd=ROOT, env=child_env(), stderr=subprocess.PIPE, text=True) as proc:
        wait_for_line(proc, "connecting to NATS", PROCESS_START)
        proc.send_signal(signum)
        assert proc.wait(timeout=PROCESS_EXIT) == 0


class NoStore:
    """A receipt store the waits under test never reach."""

    def accept_many(self, items: object, effect: object = None) -> list[str]:
        raise AssertionError("nothing is stored while waiting to connect")


def test_a_stop_ends_a_wait_that_fails_as_it_is_cancelled_and_leaves_nothing_running() -> None:
    consumer = Consumer(NoStore(), unsigned=True)
    ran_on = asyncio.Event()

    async def connect_that_fails_when_cancelled() -> str:
        try:
            await asyncio.Event().wait()  # a server that never answers
        except asyncio.CancelledError:
            raise OSError("connect aborted") from None  # as some clients do
        return "never"

    async def scenario() -> None:
        asyncio.get_running_loop().call_soon(consumer.stop)
        assert await consumer.unless_stopped(connect_that_fails_when_cancelled()) is None
        # A caller cancelled while waiting takes its work down with it.
        waiting = asyncio.ensure_future(
            Consumer(NoStore(), unsigned=True).unless_stopped(asyncio.ensure_future(ran_on.wait()))
        )
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert all(task is asyncio.current_task() for task in asyncio.all_tasks())

    asyncio.run(scenario())
