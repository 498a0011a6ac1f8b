"""Bare publishers into each broker, with no database: the broker ceilings.

Run: .venv/bin/python -m benchmarks.broker_ceiling [--quick]

As many publisher processes as the drain has relays each publish their share of
the same bodies the drains send, with the same acknowledgement the relay trusts
(a PubAck per message with Nats-Msg-Id, or a publisher confirm per persistent,
mandatory message), through the same client library and in the cheapest way we
know with it: no claims, no settles, no signatures, no other headers. Each
process sends parcels of messages, a parcel's acknowledgements awaited together,
with several parcels in flight; like the bare HTTP relay, the publishers are the
ceiling only at their best settings, so a run sweeps parcel size by parcels in
flight (benchmarks.sweep) and keeps the fastest point, measured again. Each point
is timed from the moment every process is connected and subscribed to the last
acknowledgement each one awaited, so neither start-up nor shutdown lowers the
ceiling (as a relay's drain is timed from every relay up). What the relay reaches
against this is the share of the library's reach that delivery with its
guarantees keeps; the rest of the gap to the HTTP batch drain is the broker and
its client, on a machine they share.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from benchmarks import sweep
from benchmarks.broker_drain import KINDS, PLACES, RELAYS, Place, sizes
from benchmarks.cpu import machine_busy_seconds
from benchmarks.relay_bench import DRAIN_DEADLINE_SECONDS, READY_SECONDS, log, run_alone
from outbox.canonical import canonical_bytes


def body(n: int) -> bytes:
    """The body of message `n`, as benchmarks.relay_bench.prefill stores it."""
    return canonical_bytes({"kind": "result", "n": n, "payload": "x" * 64})


@dataclass(frozen=True)
class Gate:
    """A publisher process's signals: it is connected (`ready`), it may start (`go`), and every
    message it was given is acknowledged (`done`), so the clock holds neither its start-up nor
    its shutdown."""

    ready: Any
    go: Any
    done: Any

    async def open(self) -> None:
        """Say ready, then wait for go."""
        self.ready.release()
        await asyncio.get_running_loop().run_in_executor(None, self.go.wait)


Send = Callable[[int, int], Awaitable[None]]
"""Publishes messages [first, end) as one parcel and returns once all are acknowledged."""


async def in_parcels(first: int, count: int, point: sweep.Point, send: Send) -> None:
    """Messages [first, first + count) in parcels of `point.batch`, `point.in_flight` at a time."""
    # One iterator shared by the loops: each takes the next parcel when its last is done.
    starts = iter(range(first, first + count, point.batch))

    async def loop() -> None:
        for start in starts:
            await send(start, min(start + point.batch, first + count))

    await asyncio.gather(*(loop() for _ in range(point.in_flight)))


Publish = Callable[[Sequence[str], Sequence[bytes]], Awaitable[None]]
"""Publishes bodies with their message ids as one parcel; returns once all are acknowledged."""


@asynccontextmanager
async def nats_publisher(place: Place) -> AsyncIterator[Publish]:
    """A client publishing parcels to the place's stream, each message awaiting its PubAck."""
    import nats

    client = await nats.connect(place.url, allow_reconnect=False, connect_timeout=10)
    inbox = client.new_inbox()
    prefix = len(inbox) + 1
    waiting: dict[str, asyncio.Future[bytes]] = {}

    async def on_ack(msg: Any) -> None:
        ack = waiting.pop(msg.subject[prefix:], None)
        if ack is not None:
            ack.set_result(msg.data)

    await client.subscribe(f"{inbox}.*", cb=on_ack)
    subject = place.destination["subject"].format(ordering_key="_")
    loop = asyncio.get_running_loop()

    # Each PubAck comes back on its own reply subject, told apart by a counter: a message id
    # may hold characters a subject token cannot.
    tokens = itertools.count()

    async def publish(ids: Sequence[str], bodies: Sequence[bytes]) -> None:
        acks = []
        for message_id, data in zip(ids, bodies, strict=True):
            token = str(next(tokens))
            ack: asyncio.Future[bytes] = loop.create_future()
            waiting[token] = ack
            acks.append(ack)
            headers = {"Nats-Msg-Id": message_id}
            await client.publish(subject, data, reply=f"{inbox}.{token}", headers=headers)
        for answer in await asyncio.gather(*acks):
            if "error" in json.loads(answer):
                raise RuntimeError(f"JetStream refused a publish: {answer!r}")

    try:
        yield publish
    finally:
        await client.close()


@asynccontextmanager
async def rabbitmq_publisher(place: Place) -> AsyncIterator[Publish]:
    """A channel with publisher confirms publishing persistent, mandatory messages in parcels,
    each message confirmed."""
    import aio_pika
    import aiormq

    connection = await aio_pika.connect(place.url, timeout=10)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        raw: Any = await channel.get_underlay_channel()
        exchange, key = place.destination["exchange"], place.destination["routing_key"]

        async def publish(ids: Sequence[str], bodies: Sequence[bytes]) -> None:
            await asyncio.gather(
                *(
                    raw.basic_publish(
                        data,
                        exchange=exchange,
                        routing_key=key,
                        properties=aiormq.spec.Basic.Properties(
                            message_id=message_id, delivery_mode=2
                        ),
                        mandatory=True,
                        wait=False,
                    )
                    for message_id, data in zip(ids, bodies, strict=True)
                )
            )

        yield publish
    finally:
        await connection.close()


PUBLISHERS: dict[str, Callable[[Place], AbstractAsyncContextManager[Publish]]] = {
    "nats": nats_publisher,
    "rabbitmq": rabbitmq_publisher,
}


async def lane(
    kind: str, place: Place, first: int, count: int, point: sweep.Point, gate: Gate
) -> None:
    """Publish `count` messages into the place in parcels, with its broker's acknowledgement."""
    async with PUBLISHERS[kind](place) as publish:

        async def send(start: int, end: int) -> None:
            await publish(
                [f"ceiling-{n}" for n in range(start, end)], [body(n) for n in range(start, end)]
            )

        await gate.open()
        await in_parcels(first, count, point, send)
        gate.done.release()


def publisher(
    kind: str, place: Place, first: int, count: int, point: sweep.Point, gate: Gate
) -> None:
    """A publisher process: connect, say ready, publish its share from `go` on."""
    asyncio.run(lane(kind, place, first, count, point, gate))


def bare_publish(kind: str, total: int, point: sweep.Point) -> float:
    """`total` messages published by RELAYS bare publishers at `point` into a fresh place;
    their rate, timed from `go` to the last acknowledgement."""
    spawn = multiprocessing.get_context("spawn")
    gate = Gate(spawn.Semaphore(0), spawn.Event(), spawn.Semaphore(0))
    share = total // RELAYS
    with PLACES[kind]() as place:
        procs = [
            spawn.Process(target=publisher, args=(kind, place, n * share, share, point, gate))
            for n in range(RELAYS)
        ]
        for proc in procs:
            proc.start()
        try:
            for _ in procs:
                if not gate.ready.acquire(timeout=READY_SECONDS):
                    raise RuntimeError(f"a bare {kind} publisher did not start")
            busy = machine_busy_seconds()
            started = time.monotonic()
            gate.go.set()
            finished = 0
            while finished < len(procs):
                if gate.done.acquire(timeout=0.05):
                    finished += 1
                elif any(proc.exitcode not in (None, 0) for proc in procs):
                    raise RuntimeError(f"a bare {kind} publisher failed")
                elif time.monotonic() > started + DRAIN_DEADLINE_SECONDS:
                    raise RuntimeError(f"the bare {kind} publishers did not finish in time")
            elapsed = time.monotonic() - started
            busy = machine_busy_seconds() - busy
            for proc in procs:
                proc.join(timeout=READY_SECONDS)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join()
        if any(proc.exitcode != 0 for proc in procs):
            raise RuntimeError(f"a bare {kind} publisher failed")
    moved = share * RELAYS
    rate = moved / elapsed
    log(f"  bare {kind} at {point.label}: {rate:.0f}/s, {busy * 1e6 / moved:.1f} CPU us/message")
    return float(round(rate))


def bare_points(
    kind: str, total: int, points: Iterable[sweep.Point]
) -> tuple[dict[str, float], sweep.Point]:
    """The bare publishers into `kind` at each point (sweep.chosen's figures, named
    `<kind>_bare`), and the fastest point."""
    return sweep.chosen(f"{kind}_bare", points, lambda point: bare_publish(kind, total, point))


def bare_at(kind: str, total: int, point: sweep.Point) -> dict[str, float]:
    """The bare publishers into `kind` at `point` (a sweep's winner, measured again) as
    `<kind>_bare`."""
    return {f"{kind}_bare": bare_publish(kind, total, point)}


def bare_sweep(kind: str, total: int, points: Iterable[sweep.Point]) -> dict[str, float]:
    """The bare publishers into `kind` at each point; the fastest measured again as
    `<kind>_bare`, and its point."""
    return sweep.swept(f"{kind}_bare", points, lambda point: bare_publish(kind, total, point))


def run(quick: bool, kinds: Iterable[str] = KINDS) -> dict[str, float]:
    """Each broker's bare publishers swept, one broker after the other."""
    figures: dict[str, float] = {}
    for kind in kinds:
        figures.update(bare_sweep(kind, sizes(quick), sweep.grid(quick)))
    return figures


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.broker_ceiling", run, argv)


if __name__ == "__main__":
    sys.exit(main())
