"""Helpers for NATS JetStream tests: streams of a test's own, what they store, a private server.

Each test makes its own stream (a unique name and subject prefix) and deletes it
after, so runs on the shared server never see each other's messages. Tests that
restart the server run a private `nats-server -js` on a free port.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from support.environment import IN_CI
from support.processes import PROCESS_START, reap
from support.receiver_helpers import free_port, wait_until

NATS_URL = os.environ.get("OUTBOXDEV_TEST_NATS_URL", "nats://127.0.0.1:4222")
T = TypeVar("T")


def with_jetstream(url: str, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run `work(js)` on a connection of its own (blocking), then close it."""
    import nats

    async def run() -> T:
        client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            return await work(client.jetstream(timeout=5))
        finally:
            await client.close()

    return asyncio.run(run())


def require_nats(url: str = NATS_URL) -> None:
    """Fail under CI=true, skip elsewhere, when the NATS server cannot be reached."""
    try:
        with_jetstream(url, lambda js: js.account_info())
    except Exception as exc:  # any failure to reach it means the same here
        if IN_CI:
            pytest.fail(f"NATS JetStream is required under CI=true and is unreachable: {exc}")
        pytest.skip(f"NATS JetStream unreachable at {url} ({exc})")


@dataclass
class Stream:
    """A JetStream stream of one test: its name and the subject prefix it captures."""

    url: str
    name: str
    prefix: str
    duplicate_window: float

    @property
    def subjects(self) -> str:
        """The stream's subject filter: everything under the prefix."""
        return f"{self.prefix}.>"

    def create(self) -> None:
        """Create the stream on the server."""
        with_jetstream(
            self.url,
            lambda js: js.add_stream(
                name=self.name, subjects=[self.subjects], duplicate_window=self.duplicate_window
            ),
        )

    def delete(self) -> None:
        """Delete the stream (and what it stores)."""
        with_jetstream(self.url, lambda js: js.delete_stream(self.name))

    def stored(self) -> list[Stored]:
        """Every message the stream stores, in stream order."""

        async def read(js: Any) -> list[Stored]:
            info = await js.stream_info(self.name)
            found = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                if info.state.messages == 0:
                    break
                raw = await js.get_msg(self.name, seq)
                found.append(Stored(raw.subject, raw.data, dict(raw.headers or {})))
            return found

        return with_jetstream(self.url, read)


@dataclass
class Stored:
    """One message as the stream stores it."""

    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


def new_stream(url: str = NATS_URL, duplicate_window: float = 3600) -> Stream:
    """A stream name and subject prefix unique to this test (not yet created)."""
    tag = uuid.uuid4().hex[:12]
    return Stream(url, f"OUTBOX_T_{tag}", f"t{tag}", duplicate_window)


@contextmanager
def stream_of_this_test(url: str = NATS_URL, duplicate_window: float = 3600) -> Iterator[Stream]:
    """A stream of this test's own, created now and deleted after."""
    stream = new_stream(url, duplicate_window)
    stream.create()
    try:
        yield stream
    finally:
        stream.delete()


@contextmanager
def store_kept(url: str = NATS_URL) -> Iterator[None]:
    """Within the block the shared server keeps a stream of this test process's own, empty.

    NATS 2.9 removes an account's store directory with its last stream, and a stream
    created in that moment fails ("error creating store for stream", 10049): with one
    stream kept the directory never empties while the tests create and delete theirs.
    Nothing happens when the server cannot be reached (the tests that need it say so).
    """
    keeper: Stream | None = new_stream(url)
    try:
        keeper.create()
    except Exception:  # unreachable: require_nats reports it in the tests that need it
        keeper = None
    try:
        yield
    finally:
        if keeper is not None:
            keeper.delete()


class NatsServer:
    """A private `nats-server -js` on a free loopback port, with its own store directory."""

    def __init__(self, folder: Path) -> None:
        """Nothing runs until start()."""
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not Path(binary).exists():
            message = "nats-server is not installed"
            if IN_CI:
                pytest.fail(message)
            pytest.skip(message)
        self.binary = binary
        self.store = folder / "jetstream"
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = folder / "nats-server.log"

    def start(self) -> None:
        """Start the server (on the same port and store as before) and wait for its port."""
        command = [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port)]
        command += ["-sd", str(self.store), "-l", str(self.log)]
        self.process = subprocess.Popen(command)
        try:
            wait_until(self._answers, PROCESS_START, f"nats-server on port {self.port}")
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the server: no flush, no goodbye to its clients."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        if self.process is not None:
            reap(self.process)
        self.process = None

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"nats-server exited with {self.process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False


@contextmanager
def private_nats(folder: Path) -> Iterator[NatsServer]:
    """A private nats-server, started now and killed after."""
    server = NatsServer(folder)
    server.start()
    try:
        yield server
    finally:
        server.kill()
