"""`outbox receiver consume` killed after its commit and before its ack, 10 times per broker.

Each round publishes one message and runs a real consumer process that exits at the
`receiver.consume.before_ack` failpoint, i.e. with the message's receipt and effect
committed and nothing acknowledged. The broker delivers every such message again; a
last, clean consumer finds each one a duplicate and acknowledges it. Every message's
effect exists exactly once throughout.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import nats
import pytest
from support.broker_messages import AMQP_URL, Stream, queue_waiting
from support.receiver_helpers import ROOT, SECRET, count_effects, free_port, wait_until
from test_consume_nats import publish as publish_nats
from test_consume_rabbitmq import publish as publish_rabbitmq

from outbox import failpoints
from outbox.failpoints import EXIT_CODE

# A crash proof: with the fault proofs (`make test-faults`), out of the default suite's time.
pytestmark = pytest.mark.faults

ROUNDS = 10
TRIES_PER_ROUND = 10
PROCESS_WAIT = 60.0


def consume_command(db_url: str, secret_file: Path, source: list[str]) -> list[str]:
    """The command line of one consumer process."""
    return [
        sys.executable,
        "-m",
        "outbox_cli",
        "receiver",
        "consume",
        "--db",
        db_url,
        "--secret-file",
        str(secret_file),
        *source,
    ]


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment for a child, without stray receiver settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RECEIVER_")}
    env.pop("OUTBOX_FAILPOINT", None)
    return {**env, **extra}


def run_until_killed(command: list[str]) -> None:
    """Run a consumer that must exit at the before-ack failpoint."""
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env=child_env(**failpoints.environment("receiver.consume.before_ack")),
        capture_output=True,
        timeout=PROCESS_WAIT,
        check=False,
    )
    assert proc.returncode == EXIT_CODE, proc.stderr.decode()


@contextmanager
def clean_consumer(command: list[str]) -> Iterator[Callable[[str], int]]:
    """A consumer without failpoint serving metrics; yields a reader of its counts.

    Stopped with SIGTERM at the end, which must exit 0 after settling what it holds.
    """
    port = free_port()
    proc = subprocess.Popen(
        [*command, "--metrics-port", str(port)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    def count(outcome: str) -> int:
        if proc.poll() is not None:
            raise AssertionError(f"consumer exited: {proc.communicate()[1].decode()}")
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except httpx.TransportError:
            return -1
        wanted = f'outbox_receiver_consumed_total{{outcome="{outcome}"}} '
        for line in text.splitlines():
            if line.startswith(wanted):
                return int(float(line.split()[-1]))
        return -1

    try:
        yield count
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=PROCESS_WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        assert proc.returncode == 0, err.decode()


def kill_after_commit_rounds(
    db_url: str, command: list[str], publish: Callable[[str], None]
) -> int:
    """ROUNDS rounds of: publish one message, kill consumers until it is committed; kills."""
    kills = 0
    for round_ in range(ROUNDS):
        reply_id = f"crash-{round_}"
        publish(reply_id)
        for _ in range(TRIES_PER_ROUND):
            run_until_killed(command)
            kills += 1
            if count_effects(db_url, reply_id) == 1:
                break
        else:
            raise AssertionError(f"{reply_id} never committed in {TRIES_PER_ROUND} consumers")
        for earlier in range(round_ + 1):
            assert count_effects(db_url, f"crash-{earlier}") == 1
    return kills


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A secret file holding the tests' secret."""
    path = tmp_path / "secrets"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("backend", ["postgresql"])
def test_jetstream_redelivers_what_a_killed_consumer_committed_and_it_applies_once(
    db_url: str, nats_stream: Stream, secret_file: Path
) -> None:
    source = ["--from", nats_stream.url, "--stream", nats_stream.name]
    source += ["--durable", nats_stream.durable, "--ack-wait", "1"]
    command = consume_command(db_url, secret_file, source)
    kills = kill_after_commit_rounds(
        db_url, command, lambda reply_id: asyncio.run(publish_nats(nats_stream, reply_id))
    )
    assert kills >= ROUNDS

    async def state() -> tuple[int, int]:
        client = await nats.connect(nats_stream.url)
        try:
            info = await client.jetstream().consumer_info(nats_stream.name, nats_stream.durable)
            return info.num_pending, info.num_ack_pending
        finally:
            await client.close()

    assert asyncio.run(state()) == (0, ROUNDS)  # all delivered and committed, none acknowledged
    with clean_consumer(command) as count:
        # Each one delivered again, found a duplicate, and only now acknowledged.
        wait_until(lambda: count("duplicate") == ROUNDS, PROCESS_WAIT, "every redelivery")
        wait_until(lambda: asyncio.run(state()) == (0, 0), PROCESS_WAIT, "all acknowledged")
        assert count("stored") == 0
    for round_ in range(ROUNDS):
        assert count_effects(db_url, f"crash-{round_}") == 1


@pytest.mark.parametrize("backend", ["postgresql"])
def test_rabbitmq_requeues_what_a_killed_consumer_committed_and_it_applies_once(
    db_url: str, rabbit_queue: str, secret_file: Path
) -> None:
    command = consume_command(db_url, secret_file, ["--from", AMQP_URL, "--queue", rabbit_queue])
    kills = kill_after_commit_rounds(
        db_url, command, lambda reply_id: asyncio.run(publish_rabbitmq(rabbit_queue, reply_id))
    )
    assert kills >= ROUNDS
    assert asyncio.run(queue_waiting(rabbit_queue)) == ROUNDS  # committed, none acknowledged
    with clean_consumer(command) as count:
        wait_until(lambda: count("duplicate") == ROUNDS, PROCESS_WAIT, "every redelivery")
        assert count("stored") == 0
    # Stopped: whatever it had not acknowledged would be back in the queue.
    assert asyncio.run(queue_waiting(rabbit_queue)) == 0
    for round_ in range(ROUNDS):
        assert count_effects(db_url, f"crash-{round_}") == 1
