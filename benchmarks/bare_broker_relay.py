"""Bare relays into JetStream and RabbitMQ: the ceiling a drain into a broker is held to.

Run: .venv/bin/python -m benchmarks.bare_broker_relay [--quick]
One relay: python -m benchmarks.bare_broker_relay relay KIND DB PLACE_JSON BATCH IN_FLIGHT

The least a relay with at-least-once delivery into a broker does, in psycopg 3 and
the broker's own client library directly: in one transaction, claim up to a batch
of pending, due messages with FOR UPDATE SKIP LOCKED (benchmarks.bare_relay's
claim), publish them with the acknowledgement our relay trusts, awaited together
(benchmarks.broker_ceiling's publishers: a PubAck per message with its
Nats-Msg-Id, or a publisher confirm per persistent, mandatory message), then one
UPDATE marking them sent and a commit. The claim's locks are held across the
publish, so each batch costs one transaction. With N batches in flight, N such
loops on the process's event loop, each with its own connection. Nothing else: no
signature or other headers, no fence or lease, no attempts or backoff, no ordering
keys. A loop that finds nothing polls again after 50 ms (a drain's backlog is
prefilled before the relays start).

A drain: as many bare relays as ours, timed as ours is (benchmarks.relay_bench
timed_drain, from every relay's `ready` line), on a fresh prefill and a fresh
stream or exchange; a run sweeps batch size by batches in flight
(benchmarks.sweep) and the fastest point, measured again, is the ceiling.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Iterable
from contextlib import AbstractContextManager

import psycopg

from benchmarks import sweep
from benchmarks.bare_receiver import conninfo
from benchmarks.bare_relay import CLAIM, MARK_SENT, POLL_SECONDS
from benchmarks.broker_ceiling import PUBLISHERS, Publish
from benchmarks.broker_drain import KINDS, PLACES, RELAYS, Place, sizes
from benchmarks.relay_bench import (
    fresh_database,
    log,
    prefill,
    ready_processes,
    run_alone,
    timed_drain,
)


async def deliver(db: str, publish: Publish, batch: int, up: asyncio.Semaphore) -> None:
    """One batch in flight: claim, publish and await every acknowledgement, mark sent and
    commit, forever."""
    async with await psycopg.AsyncConnection.connect(db) as conn:
        up.release()
        while True:
            rows = await (await conn.execute(CLAIM, (batch,))).fetchall()
            if not rows:
                await conn.rollback()
                await asyncio.sleep(POLL_SECONDS)
                continue
            await publish([reply_id for _, reply_id, _ in rows], [bytes(b) for _, _, b in rows])
            await conn.execute(MARK_SENT, ([row[0] for row in rows],))
            await conn.commit()


async def relay(kind: str, db: str, place: Place, batch: int, in_flight: int) -> None:
    """Deliver from `db` into the broker `place` with `in_flight` batches of up to `batch`,
    until the process is ended."""
    async with PUBLISHERS[kind](place) as publish:
        up = asyncio.Semaphore(0)
        loops = [asyncio.create_task(deliver(db, publish, batch, up)) for _ in range(in_flight)]
        for _ in loops:
            await up.acquire()
        print("ready", flush=True)
        # A loop that fails ends the process: a ceiling must not run short-handed unseen.
        done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
        for finished in done:
            finished.result()
        raise RuntimeError("a bare broker relay loop ended")


def relays(url: str, place: Place, point: sweep.Point) -> AbstractContextManager[None]:
    """RELAYS bare relays into `place` at `point`, from every one's `ready` line on."""
    settings = json.dumps(dataclasses.asdict(place))
    command = (
        "benchmarks.bare_broker_relay",
        "relay",
        place.kind,
        conninfo(url),
        settings,
        str(point.batch),
        str(point.in_flight),
    )
    return ready_processes(*[command] * RELAYS)


def bare_relay_drain(kind: str, total: int, point: sweep.Point) -> float:
    """RELAYS bare relays at `point` drain a prefilled backlog of `total` into a fresh place of
    `kind`, timed as our drain is; their rate."""
    with fresh_database() as url, PLACES[kind]() as place:
        log(f"  prefill {total} messages for the bare {kind} relay at {point.label}")
        prefill(url, total)
        result = timed_drain(url, total, lambda: relays(url, place, point), server=place.server)
    if not result["complete"]:
        raise RuntimeError(f"the bare {kind} relays did not drain: {result}")
    log(f"  bare {kind} relays at {point.label}: {result}")
    return float(result["rate"])


def bare_relay_points(
    kind: str, total: int, points: Iterable[sweep.Point]
) -> tuple[dict[str, float], sweep.Point]:
    """The bare relays into `kind` at each point (sweep.chosen's figures, named
    `<kind>_bare_relay`), and the fastest point."""
    name = f"{kind}_bare_relay"
    return sweep.chosen(name, points, lambda point: bare_relay_drain(kind, total, point))


def bare_relay_at(kind: str, total: int, point: sweep.Point) -> dict[str, float]:
    """The bare relays into `kind` at `point` (a sweep's winner, measured again) as
    `<kind>_bare_relay`."""
    return {f"{kind}_bare_relay": bare_relay_drain(kind, total, point)}


def bare_relay_sweep(kind: str, total: int, points: Iterable[sweep.Point]) -> dict[str, float]:
    """The bare relays into `kind` at each point; the fastest measured again as
    `<kind>_bare_relay`, and its point."""
    name = f"{kind}_bare_relay"
    return sweep.swept(name, points, lambda point: bare_relay_drain(kind, total, point))


def run(quick: bool, kinds: Iterable[str] = KINDS) -> dict[str, float]:
    """Each broker's bare relays swept, one broker after the other."""
    figures: dict[str, float] = {}
    for kind in kinds:
        figures |= bare_relay_sweep(kind, sizes(quick), sweep.grid(quick))
    return figures


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON; or, given `relay KIND DB PLACE BATCH IN_FLIGHT`,
    be one relay."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["relay"]:
        kind, db, settings, batch, in_flight = args[1:6]
        place = Place(**json.loads(settings))
        asyncio.run(relay(kind, db, place, int(batch), int(in_flight)))
        return 0
    return run_alone("python -m benchmarks.bare_broker_relay", run, args)


if __name__ == "__main__":
    sys.exit(main())
