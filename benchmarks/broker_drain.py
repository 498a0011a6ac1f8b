"""Drains into NATS JetStream and RabbitMQ against the HTTP batch drain, and the consumers' rate.

Run: .venv/bin/python -m benchmarks.broker_drain [--quick]

One run measures, back to back, each on a fresh PostgreSQL database with the
same prefilled backlog: the HTTP batch drain (2 relays in batch mode into the
reference receiver, as the suite's drain), the same relays with the
destination a JetStream stream, then a RabbitMQ exchange with publisher
confirms and a queue bound to it (nothing unroutable). Every drain is timed
the same way (benchmarks.relay_bench.timed_drain: from every relay up to no
message pending or sending). Then one `outbox receiver consume` process takes
what the broker holds into the receiver's tables with the reference effect,
timed from its metrics answering to its count of stored messages reaching the
backlog. Each broker's stream or exchange and queue is this run's own, deleted
after.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

import outbox
from benchmarks.relay_bench import (
    DRAIN_DEADLINE_SECONDS,
    ROOT,
    drain,
    free_port,
    fresh_database,
    log,
    prefill,
    relay_processes,
    run_alone,
    timed_drain,
    wait_healthy,
)
from outbox.receiver_tables import receipts

NATS_URL = os.environ.get("OUTBOXDEV_BENCH_NATS_URL", "nats://127.0.0.1:4222")
AMQP_URL = os.environ.get("OUTBOXDEV_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
RELAYS = 2
BATCH = 1000
"""Relays and claim batch: the suite's HTTP batch drain's."""
DUPLICATE_WINDOW = 3600.0
"""Seconds: longer than the retry window of relay_processes' settings (attempts, backoff
cap, timeout, lease), else the relays refuse to start."""
ROUTING_KEY = "replies"
KINDS = ("nats", "rabbitmq")


def sizes(quick: bool) -> int:
    """Messages per drain: the issue's 200,000, or a smoke run's few thousand."""
    return 3_000 if quick else 200_000


@dataclass(frozen=True)
class Place:
    """Where the relays publish (their destination keys) and where the consumer reads."""

    kind: str
    url: str
    destination: dict[str, str]
    source: list[str]
    server: str
    """The broker server's process name, for its CPU per message."""


def _run_async(work: Any) -> Any:
    """Run one coroutine to its end on a loop of its own."""
    return asyncio.run(work)


@contextmanager
def jetstream_place() -> Iterator[Place]:
    """A stream of this run's own (its duplicate window longer than the retry window); deleted
    after, with the durable consumer on it."""
    import nats

    tag = uuid.uuid4().hex[:12]
    name, prefix = f"OUTBOX_BENCH_{tag}", f"bench{tag}"

    async def with_jetstream(work: Any) -> None:
        client = await nats.connect(NATS_URL, allow_reconnect=False, connect_timeout=5)
        try:
            await work(client.jetstream(timeout=30))
        finally:
            await client.close()

    _run_async(
        with_jetstream(
            lambda js: js.add_stream(
                name=name, subjects=[f"{prefix}.>"], duplicate_window=DUPLICATE_WINDOW
            )
        )
    )
    try:
        yield Place(
            "nats",
            NATS_URL,
            {"kind": "nats", "stream": name, "subject": f"{prefix}.{{ordering_key}}"},
            ["--from", NATS_URL, "--stream", name, "--durable", f"bench_{tag}"],
            "nats-server",
        )
    finally:
        _run_async(with_jetstream(lambda js: js.delete_stream(name)))


@contextmanager
def rabbitmq_place() -> Iterator[Place]:
    """A durable topic exchange and a durable queue bound to it by `#`, of this run's own;
    deleted after."""
    import aio_pika

    tag = uuid.uuid4().hex[:12]
    exchange, queue = f"outbox-bench-{tag}", f"outbox-bench-{tag}"

    async def declare() -> None:
        async with await aio_pika.connect(AMQP_URL, timeout=10) as connection:
            channel = await connection.channel()
            declared = await channel.declare_exchange(exchange, "topic", durable=True)
            bound = await channel.declare_queue(queue, durable=True)
            await bound.bind(declared, "#")

    async def delete() -> None:
        async with await aio_pika.connect(AMQP_URL, timeout=10) as connection:
            channel = await connection.channel()
            await channel.queue_delete(queue)
            await channel.exchange_delete(exchange)

    _run_async(declare())
    try:
        yield Place(
            "rabbitmq",
            AMQP_URL,
            {"kind": "rabbitmq", "exchange": exchange, "routing_key": ROUTING_KEY},
            ["--from", AMQP_URL, "--queue", queue],
            "beam.smp",
        )
    finally:
        _run_async(delete())


PLACES = {"nats": jetstream_place, "rabbitmq": rabbitmq_place}


def consumed(port: int, outcome: str) -> int:
    """The consumer's count of messages with `outcome`, from its /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    wanted = f'outbox_receiver_consumed_total{{outcome="{outcome}"}} '
    for line in text.splitlines():
        if line.startswith(wanted):
            return int(float(line.split()[-1]))
    return 0


def count_receipts(url: str) -> int:
    """Receipts the receiver's tables hold (a full count: for the end of a run)."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(receipts)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def consume(url: str, place: Place, total: int, workdir: Path) -> dict[str, Any]:
    """One `outbox receiver consume` takes the `total` messages `place` holds; timed."""
    secret_file = workdir / "secret"
    port = free_port()
    command = [sys.executable, "-m", "outbox_cli", "receiver", "consume", "--db", url]
    command += ["--secret-file", str(secret_file), *place.source]
    command += ["--metrics-port", str(port), "--log-level", "WARNING"]
    # Our interpreter running our CLI, with arguments built here.
    launched = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz")
        started = time.monotonic()
        before = consumed(port, "stored")
        deadline = started + DRAIN_DEADLINE_SECONDS
        pause = threading.Event()
        while (done := consumed(port, "stored")) < total:
            if proc.poll() is not None:
                raise RuntimeError(f"the consumer died: {proc.communicate()[1].decode()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the consumer stored {done} of {total} in time")
            pause.wait(0.05)
        finished = time.monotonic()
        others = {o: consumed(port, o) for o in ("duplicate", "conflict", "invalid", "retry")}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    stored = count_receipts(url)
    if stored != total or any(others.values()):
        raise RuntimeError(f"the consumer stored {stored} of {total}; other outcomes: {others}")
    timed_from = "metrics up"
    if before > total // 2:
        # A small backlog: most of it was stored while the metrics came up. Time it all.
        started, before, timed_from = launched, 0, "consumer started"
    elapsed = finished - started
    return {
        "messages": total,
        "seconds": round(elapsed, 2),
        "rate": round((done - before) / elapsed),
        "timed_from": timed_from,
    }


def broker_drain(kind: str, total: int, then_consume: bool = True) -> dict[str, float]:
    """Relays drain `total` messages into the broker `kind`, then (unless `then_consume` is
    false) a consumer takes them."""
    with (
        fresh_database() as url,
        tempfile.TemporaryDirectory() as tmp,
        PLACES[kind]() as place,
    ):
        workdir = Path(tmp)
        log(f"  prefill {total} messages for {kind}")
        prefill(url, total)
        drained = timed_drain(
            url,
            total,
            lambda: relay_processes(
                url, place.url, workdir, RELAYS, "batch", BATCH, broker=place.destination
            ),
            server=place.server,
        )
        if not drained["complete"]:
            raise RuntimeError(f"the relays did not drain into {kind}: {drained}")
        log(f"  {kind}: drained {drained}")
        figures = {
            kind: float(drained["rate"]),
            f"{kind}_cpu_us": float(drained["cpu_us_per_message"]),
            f"{kind}_server_cpu_us": float(drained["server_cpu_us_per_message"]),
        }
        if then_consume:
            consumer = consume(url, place, total, workdir)
            log(f"  {kind}: consumed {consumer}")
            figures[f"{kind}_consume"] = float(consumer["rate"])
    return figures


def http_drain(total: int) -> dict[str, float]:
    """The HTTP batch drain of the same backlog: the suite's drain (benchmarks.relay_bench);
    its rate and the machine's CPU per message."""
    result = drain(total, "batch", RELAYS, BATCH)
    if not result["complete"]:
        raise RuntimeError(f"the relays did not drain over HTTP: {result}")
    return {"http": float(result["rate"]), "http_cpu_us": float(result["cpu_us_per_message"])}


def run(quick: bool, kinds: Iterable[str] = KINDS) -> dict[str, float]:
    """The HTTP batch drain, then each broker's drain and consumer, back to back."""
    total = sizes(quick)
    figures = http_drain(total)
    for kind in kinds:
        figures.update(broker_drain(kind, total))
    return figures


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.broker_drain", run, argv)


if __name__ == "__main__":
    sys.exit(main())
