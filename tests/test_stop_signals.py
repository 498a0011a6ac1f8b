"""Every process kind stops promptly on SIGTERM and SIGINT, whatever it is waiting for.

Each test starts a real `outbox` process, brings it into one wait (a database or a
broker that refuses or never answers, at start or lost mid-run; a backoff; an idle
poll; a handler or a request that never ends), sends a stop signal and requires the
exit within STOP_DEADLINE with the status and the log line docs/how-to/operations.md
gives for it. Unreachable means a port nobody listens on (refused at once) or a
SilentServer (accepted, never answered); lost mid-run means a StreamProxy stopped
under the process. The table in docs/how-to/operations.md is this file's matrix. The
waits that need a broker or a proxy cut mid-run are marked `faults` (`make test-faults`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from faults.stream_proxy import StreamProxy
from sqlalchemy.orm import Session
from support.broker_messages import AMQP_URL, NATS_URL, outbox_headers
from support.nats_helpers import Stream, require_nats, stream_of_this_test
from support.processes import PROCESS_START, spawned
from support.rabbitmq import topology
from support.receiver_helpers import ROOT, SECRET, free_port, wait_until
from support.scripted_server import Answer, ScriptedServer

import outbox
from outbox import AuthContext, Envelope, TaskQueue

STOP_DEADLINE = 10.0
"""Seconds a process has to exit once signalled: generous (a loaded machine), not a claim
of speed; a wait a signal cannot end lasts minutes or for ever."""
SIGNALS = [signal.SIGTERM, signal.SIGINT]


def stopped_by(signum: signal.Signals) -> str:
    """The line a service ends with when a signal stops it before its own stop handling
    runs (or, for uvicorn, after: it raises the signal again once it has shut down)."""
    return f"stopped by {signum.name}"


@pytest.fixture
def backend() -> str:
    """PostgreSQL: the LISTEN waits are its own, and a proxy can cut it off."""
    return "postgresql"


class SilentServer:
    """Accepts TCP connections on a loopback port and never answers nor closes them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self._held.append(conn)
            self.accepted.set()

    def close(self) -> None:
        """Stop listening and drop what it holds."""
        self.sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    """A server that accepts and never answers: a connect or request waits on it."""
    server = SilentServer()
    yield server
    server.close()


def via(url: str, port: int) -> str:
    """`url` with its port replaced (a proxy, a closed port)."""
    return sa.make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


@contextmanager
def proxied(url: str) -> Iterator[tuple[StreamProxy, str]]:
    """A StreamProxy in front of `url`'s server, and `url` through it."""
    parsed = sa.make_url(url)
    with StreamProxy(parsed.host or "127.0.0.1", parsed.port or 5432) as proxy:
        yield proxy, via(url, proxy.port)


class Child:
    """An `outbox` process whose stderr and stdout go to a file the test reads."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def text(self) -> str:
        """What it logged so far."""
        return self.log.read_text(errors="replace")

    def wait_for(self, wanted: str, seconds: float = PROCESS_START) -> None:
        """Return once `wanted` is in the log; fail if the process ends or `seconds` pass."""

        def seen() -> bool:
            if wanted in self.text():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"exited ({self.proc.returncode}) before {wanted!r}:\n"
                                     f"{self.text()}")  # fmt: skip
            return False

        wait_until(seen, seconds, f"{wanted!r} in the log:\n{self.text()}")

    def stop(self, signum: signal.Signals, status: int | tuple[int, ...], line: str) -> None:
        """Send `signum`; the process must exit within STOP_DEADLINE with `status`, saying
        `line`."""
        self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {STOP_DEADLINE:g} s after {signum.name}:\n{self.text()}"
            ) from None
        statuses = status if isinstance(status, tuple) else (status,)
        assert self.proc.returncode in statuses, self.text()
        assert line in self.text(), self.text()


@contextmanager
def outbox_process(tmp_path: Path, *argv: str, **env: str) -> Iterator[Child]:
    """`python -m outbox_cli *argv` from this tree, killed and reaped on the way out."""
    log = tmp_path / f"{argv[0]}.log"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX")}
    environment.update(PYTHONPATH=str(ROOT / "tests"), **env)
    command = [sys.executable, "-m", "outbox_cli", *argv]
    with (
        log.open("wb") as sink,
        spawned(command, cwd=ROOT, env=environment, stdout=sink, stderr=subprocess.STDOUT) as proc,
    ):
        yield Child(proc, log)


def publish(db_url: str, reply_id: str, destination: str = "default") -> None:
    """One outbox message for `destination`."""
    engine = outbox.create_engine(db_url)
    try:
        with Session(engine) as session, session.begin():
            outbox.publish(session, destination, reply_id, {"id": reply_id})
    finally:
        engine.dispose()


def secret_file(tmp_path: Path) -> Path:
    """The signing secret, in a file."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return path


def relay_config(tmp_path: Path, lease: float = 10, **destination: object) -> Path:
    """A relay TOML file with one destination, `default`."""
    settings = {"secret_file": str(secret_file(tmp_path)), "timeout": 5, **destination}
    lines = ["[relay]", f"lease = {lease}", "poll_interval = 0.1", "[destinations.default]"]
    lines += [f"{key} = {value!r}".replace("'", '"') for key, value in settings.items()]
    path = tmp_path / "relay.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def closed_port_url(url: str) -> str:
    """`url` pointing at a loopback port nobody listens on (refused at once)."""
    return via(url, free_port())


# --- outbox worker ------------------------------------------------------------------


def worker_args(db: str, handler: str = "double", *extra: str) -> list[str]:
    """The command line of a worker."""
    return ["worker", "--db", db, "--handler", f"support.worker_handlers:{handler}",
            "--poll-interval", "0.1", *extra]  # fmt: skip


@pytest.mark.parametrize("signum", SIGNALS)
def test_worker_idle(db_url: str, tmp_path: Path, signum: signal.Signals) -> None:
    with outbox_process(tmp_path, *worker_args(db_url)) as worker:
        worker.wait_for("started: concurrency")
        worker.stop(signum, 0, "stopped: drained")


@pytest.mark.parametrize("signum", SIGNALS)
def test_worker_connecting_to_a_silent_database(
    silent: SilentServer, tmp_path: Path, signum: signal.Signals
) -> None:
    db = via("postgresql+psycopg://postgres@127.0.0.1/x", silent.port)
    with outbox_process(tmp_path, *worker_args(db)) as worker:
        assert silent.accepted.wait(PROCESS_START)
        worker.stop(signum, 0, stopped_by(signum))


def test_worker_with_a_handler_that_never_returns(db_url: str, tmp_path: Path) -> None:
    queue = TaskQueue(db_url, allowed_sources=("agent-a",))
    try:
        task = queue.receive(AuthContext("agent-a"), Envelope("t", "agent-a", {"n": 1},
                                                              time.time() + 3600))  # fmt: skip
    finally:
        queue.close()
    gate = tmp_path / "gate"
    gate.mkdir()
    args = worker_args(db_url, "gated", "--grace", "1")
    with outbox_process(tmp_path, *args, OUTBOXDEV_TEST_GATE=str(gate)) as worker:
        wait_until((gate / f"started-{task.task_id}").exists, PROCESS_START, "the handler")
        # Never released: the drain gives it `grace`, then abandons it to lease expiry.
        worker.stop(signal.SIGTERM, 0, "1 running tasks abandoned")


@pytest.mark.faults
def test_worker_whose_database_is_lost(db_url: str, tmp_path: Path) -> None:
    with proxied(db_url) as (proxy, db), outbox_process(tmp_path, *worker_args(db)) as worker:
        worker.wait_for("started: concurrency")
        proxy.stop()  # every connection cut, and refused from now on
        worker.wait_for("claim failed")
        worker.stop(signal.SIGTERM, 0, "stopped")


# --- outbox relay -------------------------------------------------------------------


def relay_args(db: str, config: Path, *extra: str) -> list[str]:
    """The command line of a relay."""
    return ["relay", "--db", db, "--config", str(config), *extra]


@pytest.mark.parametrize("signum", SIGNALS)
def test_relay_idle(db_url: str, tmp_path: Path, signum: signal.Signals) -> None:
    config = relay_config(tmp_path, url=f"http://127.0.0.1:{free_port()}/")
    with outbox_process(tmp_path, *relay_args(db_url, config)) as relay:
        relay.wait_for(" started")
        relay.stop(signum, 0, " stopped")


@pytest.mark.parametrize("signum", SIGNALS)
def test_relay_connecting_to_a_silent_database(
    silent: SilentServer, tmp_path: Path, signum: signal.Signals
) -> None:
    config = relay_config(tmp_path, url=f"http://127.0.0.1:{free_port()}/")
    db = via("postgresql+psycopg://postgres@127.0.0.1/x", silent.port)
    with outbox_process(tmp_path, *relay_args(db, config)) as relay:
        assert silent.accepted.wait(PROCESS_START)
        relay.stop(signum, 0, stopped_by(signum))


def test_relay_backing_off_from_a_refusing_destination(db_url: str, tmp_path: Path) -> None:
    publish(db_url, "m-1")
    config = relay_config(tmp_path, url=f"http://127.0.0.1:{free_port()}/")
    with outbox_process(tmp_path, *relay_args(db_url, config)) as relay:
        relay.wait_for("m-1 to default retry")
        relay.stop(signal.SIGTERM, 0, " stopped")


def test_relay_checking_a_destination_that_never_answers(
    db_url: str, silent: SilentServer, tmp_path: Path
) -> None:
    # At start the relay asks each destination for its receipt retention: that request
    # would last its whole timeout (up to the lease) before the stop was seen.
    url = f"http://127.0.0.1:{silent.port}/"
    config = relay_config(tmp_path, lease=60, url=url, timeout=3 * STOP_DEADLINE)
    with outbox_process(tmp_path, *relay_args(db_url, config)) as relay:
        assert silent.accepted.wait(PROCESS_START)
        relay.stop(signal.SIGTERM, 0, "stopped before it started")


def test_relay_with_a_request_that_is_never_answered(db_url: str, tmp_path: Path) -> None:
    publish(db_url, "m-1")
    held = threading.Event()  # never set before the relay has stopped
    with ScriptedServer() as server:
        server.script("m-1", Answer(gate=held))
        config = relay_config(tmp_path, url=server.url, timeout=8)
        try:
            with outbox_process(tmp_path, *relay_args(db_url, config, "--grace", "1")) as relay:
                wait_until(lambda: server.ids() == ["m-1"], PROCESS_START, "the POST")
                # The attempt would last 8 s: the drain gives it `grace`, then abandons it.
                relay.stop(signal.SIGTERM, 0, "abandoned in-flight work")
        finally:
            held.set()


def nats_destination(stream: Stream, url: str) -> dict[str, object]:
    """A relay destination publishing to `stream` through `url`."""
    return {"kind": "nats", "url": url, "stream": stream.name, "subject": f"{stream.prefix}.m"}


def rabbit_destination(exchange: str, url: str) -> dict[str, object]:
    """A relay destination publishing to `exchange` through `url`."""
    return {"kind": "rabbitmq", "url": url, "exchange": exchange, "routing_key": "m"}


def test_relay_whose_nats_is_unreachable(db_url: str, tmp_path: Path) -> None:
    publish(db_url, "m-1")
    stream = Stream(NATS_URL, "NOWHERE", "nowhere", 60)
    config = relay_config(tmp_path, **nats_destination(stream, closed_port_url(NATS_URL)))
    with outbox_process(tmp_path, *relay_args(db_url, config)) as relay:
        relay.wait_for("m-1 to default retry")
        relay.stop(signal.SIGTERM, 0, " stopped")


@pytest.mark.faults
def test_relay_whose_nats_is_lost(db_url: str, tmp_path: Path) -> None:
    require_nats()
    with stream_of_this_test() as stream, proxied(NATS_URL) as (proxy, url):
        config = relay_config(tmp_path, **nats_destination(stream, url))
        with outbox_process(tmp_path, *relay_args(db_url, config)) as relay:
            publish(db_url, "m-1")
            relay.wait_for("1 sent")
            proxy.stop()
            publish(db_url, "m-2")
            relay.wait_for("m-2 to default retry")
            relay.stop(signal.SIGTERM, 0, " stopped")


def test_relay_whose_rabbitmq_is_unreachable(db_url: str, tmp_path: Path) -> None:
    publish(db_url, "m-1")
    config = relay_config(tmp_path, **rabbit_destination("x", closed_port_url(AMQP_URL)))
    with outbox_process(tmp_path, *relay_args(db_url, config)) as relay:
        relay.wait_for("m-1 to default")
        relay.stop(signal.SIGTERM, 0, " stopped")


@pytest.mark.faults
def test_relay_whose_rabbitmq_is_lost(db_url: str, tmp_path: Path) -> None:
    with topology() as made, proxied(AMQP_URL) as (proxy, url):
        config = relay_config(tmp_path, **rabbit_destination(made.exchange, url))
        with outbox_process(tmp_path, *relay_args(db_url, config)) as relay:
            publish(db_url, "m-1")
            relay.wait_for("1 sent")
            proxy.stop()
            publish(db_url, "m-2")
            relay.wait_for("m-2 to default")
            relay.stop(signal.SIGTERM, 0, " stopped")


# --- outbox receiver (HTTP) ---------------------------------------------------------


def receiver_args(db: str, tmp_path: Path, *extra: str) -> list[str]:
    """The command line of an HTTP receiver on a free port."""
    return ["receiver", "--db", db, "--port", str(free_port()),
            "--secret-file", str(secret_file(tmp_path)), *extra]  # fmt: skip


@pytest.mark.parametrize("signum", SIGNALS)
def test_receiver_idle(db_url: str, tmp_path: Path, signum: signal.Signals) -> None:
    with outbox_process(tmp_path, *receiver_args(db_url, tmp_path)) as receiver:
        receiver.wait_for("Started server process")
        # uvicorn shuts down, then raises the signal again: that too is a clean stop.
        receiver.stop(signum, 0, stopped_by(signum))
        assert "Finished server process" in receiver.text()


@pytest.mark.parametrize("signum", SIGNALS)
def test_receiver_with_two_workers(db_url: str, tmp_path: Path, signum: signal.Signals) -> None:
    args = receiver_args(db_url, tmp_path, "--workers", "2")
    with outbox_process(tmp_path, *args) as receiver:
        wait_until(
            lambda: receiver.text().count("Started server process") == 2,
            PROCESS_START,
            "two workers",
        )
        receiver.stop(signum, 0, "Finished server process")


def test_receiver_connecting_to_a_silent_database(silent: SilentServer, tmp_path: Path) -> None:
    db = via("postgresql+psycopg://postgres@127.0.0.1/x", silent.port)
    with outbox_process(tmp_path, *receiver_args(db, tmp_path)) as receiver:
        assert silent.accepted.wait(PROCESS_START)
        receiver.stop(signal.SIGTERM, 0, stopped_by(signal.SIGTERM))


# --- outbox receiver consume --------------------------------------------------------


def consume_args(db: str, tmp_path: Path, *source: str) -> list[str]:
    """The command line of a broker consumer."""
    return ["receiver", "consume", "--db", db, "--secret-file", str(secret_file(tmp_path)),
            *source]  # fmt: skip


def publish_to_stream(stream: Stream, reply_id: str) -> None:
    """One signed message on `stream`, as the relay publishes it."""
    import nats

    body = b'{"id":"' + reply_id.encode() + b'"}'

    async def send() -> None:
        client = await nats.connect(stream.url)
        try:
            headers = {**outbox_headers(reply_id, body, SECRET), "Nats-Msg-Id": reply_id}
            await client.jetstream().publish(f"{stream.prefix}.k", body, headers=headers)
        finally:
            await client.close()

    asyncio.run(send())


@pytest.mark.faults
def test_consumer_whose_nats_is_lost(db_url: str, tmp_path: Path) -> None:
    require_nats()
    with stream_of_this_test() as stream, proxied(NATS_URL) as (proxy, url):
        args = consume_args(db_url, tmp_path, "--from", url, "--stream", stream.name,
                            "--durable", "d")  # fmt: skip
        with outbox_process(tmp_path, *args) as consumer:
            consumer.wait_for("consuming stream")
            proxy.stop()
            consumer.wait_for("NATS at ")  # each failed reconnect says so
            consumer.stop(signal.SIGTERM, 0, "consumer stopped")


@pytest.mark.parametrize("signum", SIGNALS)
def test_consumer_whose_rabbitmq_never_answers(
    db_url: str, silent: SilentServer, tmp_path: Path, signum: signal.Signals
) -> None:
    # A refused connect fails at start (status 3): one that is never answered is the wait.
    args = consume_args(db_url, tmp_path, "--from", via(AMQP_URL, silent.port), "--queue", "q")
    with outbox_process(tmp_path, *args) as consumer:
        assert silent.accepted.wait(PROCESS_START)
        consumer.stop(signum, 0, "stopped before RabbitMQ answered")


@pytest.mark.faults
def test_consumer_whose_rabbitmq_is_lost(db_url: str, tmp_path: Path) -> None:
    with topology() as made, proxied(AMQP_URL) as (proxy, url):
        args = consume_args(db_url, tmp_path, "--from", url, "--queue", made.queue)
        with outbox_process(tmp_path, *args) as consumer:
            consumer.wait_for("consuming queue")
            proxy.stop()
            consumer.wait_for("trying again")  # the reconnect refused, backing off
            consumer.stop(signal.SIGTERM, 0, "consumer stopped")


@pytest.mark.faults
def test_consumer_whose_database_is_down_while_messages_wait(db_url: str, tmp_path: Path) -> None:
    require_nats()
    with stream_of_this_test() as stream, proxied(db_url) as (proxy, db):
        args = consume_args(db, tmp_path, "--from", NATS_URL, "--stream", stream.name,
                            "--durable", "d")  # fmt: skip
        with outbox_process(tmp_path, *args) as consumer:
            consumer.wait_for("consuming stream")
            proxy.stop()
            publish_to_stream(stream, "m-1")
            consumer.wait_for("receipt store unavailable")  # backing off, to retry
            consumer.stop(signal.SIGTERM, 0, "consumer stopped")


# --- outbox console -----------------------------------------------------------------


def console_args(db: str) -> list[str]:
    """The command line of a console on a free port."""
    return ["console", "--db", db, "--port", str(free_port())]


@pytest.mark.parametrize("signum", SIGNALS)
def test_console_idle(db_url: str, tmp_path: Path, signum: signal.Signals) -> None:
    with outbox_process(tmp_path, *console_args(db_url)) as console:
        console.wait_for("Started server process")
        console.stop(signum, 0, stopped_by(signum))
        assert "Finished server process" in console.text()


def test_console_connecting_to_a_silent_database(silent: SilentServer, tmp_path: Path) -> None:
    db = via("postgresql+psycopg://postgres@127.0.0.1/x", silent.port)
    with outbox_process(tmp_path, *console_args(db)) as console:
        assert silent.accepted.wait(PROCESS_START)
        console.stop(signal.SIGTERM, 0, stopped_by(signal.SIGTERM))
