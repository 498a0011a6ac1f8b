"""Relays and a consumer as real processes around one broker: the end-to-end broker proofs.

A `Deployment` writes one TOML file whose `default` destination is a NATS stream
or a RabbitMQ exchange, starts relay processes from it (each maybe set to die at a
failpoint) and one `outbox receiver consume` process that applies the reference
effect into the same database. The invariant checker (faults.invariants) then
reads the outbox and the receiver's tables: a reply the relay committed as sent
must have exactly one receipt and one effect, whatever the broker held.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from support.nats_helpers import NATS_URL, Stream, new_stream, require_nats
from support.rabbitmq import AMQP_URL, Topology, topology
from support.receiver_helpers import free_port, wait_until
from support.relay_helpers import SECRET

from faults import invariants
from faults.nodes import Node

ROUTING_KEY = "replies"


@dataclass
class Broker:
    """Where a destination publishes and where the consumer reads: one test's own."""

    kind: str
    url: str
    destination: dict[str, str]
    """The kind's own destination keys (stream and subject, or exchange and routing_key)."""
    source: list[str]
    """The consumer's command-line arguments naming the same place."""
    stream: Stream | None = None
    topology: Topology | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The broker's host and port, for a proxy in front of it."""
        host_port = self.url.split("://", 1)[1].split("@")[-1].split("/")[0]
        host, _, port = host_port.rpartition(":")
        return host, int(port)

    def via(self, port: int) -> str:
        """The broker's URL with its address replaced by 127.0.0.1:`port` (a proxy's)."""
        host, own_port = self.address
        return self.url.replace(f"{host}:{own_port}", f"127.0.0.1:{port}", 1)


@contextmanager
def jetstream(url: str = NATS_URL) -> Iterator[Broker]:
    """A stream of this test's own on the NATS server at `url` and a durable name; deleted after."""
    require_nats(url)
    stream = new_stream(url)
    stream.create()
    durable = f"outbox_t_{uuid.uuid4().hex[:12]}"
    try:
        yield Broker(
            "nats",
            url,
            {"stream": stream.name, "subject": f"{stream.prefix}.{{ordering_key}}"},
            ["--from", url, "--stream", stream.name, "--durable", durable],
            stream=stream,
        )
    finally:
        stream.delete()


@contextmanager
def rabbitmq() -> Iterator[Broker]:
    """An exchange and a queue bound to it, of this test's own; deleted after."""
    with topology() as made:
        yield Broker(
            "rabbitmq",
            AMQP_URL,
            {"exchange": made.exchange, "routing_key": ROUTING_KEY},
            ["--from", AMQP_URL, "--queue", made.queue],
            topology=made,
        )


@contextmanager
def broker(kind: str) -> Iterator[Broker]:
    """The broker `kind` names ("nats" or "rabbitmq"), with a place of this test's own."""
    makers = {"nats": jetstream, "rabbitmq": rabbitmq}
    if kind not in makers:
        raise ValueError(f"kind must be one of {sorted(makers)}, got {kind!r}")
    with makers[kind]() as ready:
        yield ready


@dataclass
class Deployment:
    """Relay processes and one consumer process around `broker`, sharing one database."""

    folder: Path
    db_url: str
    broker: Broker
    relay_url: str | None = None
    """Where the relays connect when not to the broker itself (a proxy in front of it)."""
    batch: int = 4
    lease: float = 2.0
    max_batch_items: int | None = None
    """Messages per parcel (the destination's max_batch_items); None: the default."""
    nodes: list[Node] = field(default_factory=list)
    metrics_port: int = 0

    def __post_init__(self) -> None:
        """Write the secret and the config file the relays read."""
        secret_file = self.folder / "secret"
        secret_file.write_text(SECRET + "\n", encoding="utf-8")
        self.secret_file = secret_file
        self.config = self.folder / "outbox.toml"
        keys = [f'{key} = "{value}"' for key, value in self.broker.destination.items()]
        if self.max_batch_items is not None:
            keys.append(f"max_batch_items = {self.max_batch_items}")
        self.config.write_text(
            "\n".join(
                [
                    f'db = "{self.db_url}"',
                    "[relay]",
                    # A publish (timeout 1 s) must fit in the lease.
                    f"lease = {self.lease}",
                    "poll_interval = 0.1",
                    "backoff = 0.05",
                    "backoff_cap = 0.3",
                    "max_attempts = 100",
                    f"batch = {self.batch}",
                    "[destinations.default]",
                    f'kind = "{self.broker.kind}"',
                    f'url = "{self.relay_url or self.broker.url}"',
                    *keys,
                    f'secret_file = "{secret_file}"',
                    "timeout = 1",
                    "",
                ]
            ),
            encoding="utf-8",
        )

    def __enter__(self) -> Deployment:
        """The deployment; every process is stopped on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop every process still running."""
        for node in self.nodes:
            node.stop()

    def relay(self, failpoint: str | None = None, action: str = "exit") -> Node:
        """Start a relay process (`python -m outbox_cli relay --config ...` in a fork)."""
        name = f"relay-{len(self.nodes) + 1}"
        argv = ["relay", "--config", str(self.config), "--owner", name]
        return self._launch(name, argv, failpoint, action)

    def consumer(self, failpoint: str | None = None, options: Sequence[str] = ()) -> Node:
        """Start `outbox receiver consume` with metrics and `options`; returns once they
        answer, or at once when it is set to die at `failpoint` (it may die before)."""
        self.metrics_port = free_port()
        argv = ["receiver", "consume", "--db", self.db_url]
        argv += ["--secret-file", str(self.secret_file), *self.broker.source, *options]
        argv += ["--metrics-port", str(self.metrics_port)]
        node = self._launch(f"consumer-{len(self.nodes) + 1}", argv, failpoint)
        if failpoint is None:
            wait_until(lambda: self.consumed("stored") >= 0, 30, "the consumer's metrics")
        return node

    def consumed(self, outcome: str) -> int:
        """The consumer's count of messages with `outcome`; -1 while its metrics do not answer."""
        self.check_running()
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).text
        except httpx.TransportError:
            return -1
        wanted = f'outbox_receiver_consumed_total{{outcome="{outcome}"}} '
        for line in text.splitlines():
            if line.startswith(wanted):
                return int(float(line.split()[-1]))
        return 0

    def drain(self, published: list[str], timeout: float = 60.0) -> invariants.Tally:
        """Wait until every reply is settled and received (or `timeout`); count the invariants."""
        return invariants.drain(
            self.db_url, timeout=timeout, published=published, watch=self.check_running
        )

    def check_running(self) -> None:
        """Fail at once when a process started without a failpoint has exited unasked."""
        for node in self.nodes:
            if node.failpoint is None and not node.retired and node.exitcode is not None:
                raise AssertionError(f"{node.name} exited with {node.exitcode}\n{self.logs()}")

    def logs(self) -> str:
        """The tail of every process's output, for failure messages."""
        return "\n".join(f"--- {n.name} (exit {n.exitcode})\n{n.tail()}" for n in self.nodes)

    def _launch(
        self, name: str, argv: list[str], failpoint: str | None, action: str = "exit"
    ) -> Node:
        node = Node(name, "faults.work:cli", [argv], self.folder / f"{name}.log", failpoint, action)
        self.nodes.append(node)
        return node
