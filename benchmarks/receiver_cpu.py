"""The reference receiver's CPU per stored reply in batch mode, with no relay beside it.

Run: .venv/bin/python -m benchmarks.receiver_cpu [--quick]

A real receiver process (`outbox receiver`, one worker) on a fresh PostgreSQL
database takes batch POSTs of 1,000 replies each, packed and signed as the
relay's batch mode packs and signs them (relay.transports.http.pack_batches,
relay.webhooks.request_headers), from a few client threads in this process.
The bodies are built before the clock starts, so the client's work is mostly
off the figure's machine time; the figure itself is the receiver process's own
CPU time (utime + stime from /proc) over the timed batches, divided by the
replies it answered ``stored``. A first batch, not counted, warms the
receiver's imports, pool and statement caches.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import MappingProxyType

import httpx

from benchmarks.cpu import process_tree_cpu_seconds
from benchmarks.relay_bench import (
    BATCH_ITEMS,
    SECRET,
    children_running,
    fresh_database,
    log,
    receiver_process,
    run_alone,
)
from outbox.canonical import canonical_bytes, sha256_hex
from outbox.messages import BATCH_ID_PREFIX
from relay.config import make_destination
from relay.records import Message
from relay.transports.http import pack_batches
from relay.webhooks import request_headers

CLIENTS = 4
"""Batches in flight at once: the receiver overlaps parsing one with storing another."""
BATCHES = 200
QUICK_BATCHES = 6
MAX_BATCH_BYTES = 1_000_000


def bodies(first: int, count: int) -> list[tuple[str, bytes]]:
    """(batch id, body) for `count` batches of BATCH_ITEMS messages from message `first` on."""
    messages = []
    for n in range(first, first + count * BATCH_ITEMS):
        body = canonical_bytes({"kind": "result", "n": n, "payload": "x" * 64})
        messages.append(
            Message(n, f"bench-{n}", "default", body, sha256_hex(body), MappingProxyType({}), 0, 0)
        )
    packed = pack_batches(messages, BATCH_ITEMS, MAX_BATCH_BYTES)
    return [
        (f"{BATCH_ID_PREFIX}{group[0].id}-{group[-1].id}-{len(group)}", body)
        for group, body in packed
    ]


def post_all(url: str, batches: Iterable[tuple[str, bytes]], clients: int) -> int:
    """POST every batch from `clients` threads; the replies answered stored."""
    destination = make_destination(url=url, secret=SECRET, mode="batch")
    work: Iterator[tuple[str, bytes]] = iter(list(batches))
    lock = threading.Lock()
    stored = [0] * clients
    failures: list[BaseException] = []

    def client(index: int) -> None:
        try:
            with httpx.Client(timeout=60) as http:
                while True:
                    with lock:
                        batch = next(work, None)
                    if batch is None:
                        return
                    batch_id, body = batch
                    # Signed when sent, as the relay does: the timestamp must be fresh.
                    headers = request_headers(destination, batch_id, body)
                    answer = http.post(url + "/batch", content=body, headers=headers)
                    answer.raise_for_status()
                    results = answer.json()["results"]
                    stored[index] += sum(r["status"] == "stored" for r in results)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return sum(stored)


def run(quick: bool) -> dict[str, float]:
    """One measurement: the receiver's CPU microseconds per stored reply."""
    count = QUICK_BATCHES if quick else BATCHES
    log(f"packing {count + 1} batches of {BATCH_ITEMS}")
    warmup, *timed = bodies(0, count + 1)
    with (
        fresh_database() as db,
        tempfile.TemporaryDirectory() as tmp,
        receiver_process(db, Path(tmp)) as url,
    ):
        [pid] = children_running("receiver")
        post_all(url, [warmup], 1)
        cpu_before = process_tree_cpu_seconds(pid)
        started = time.monotonic()
        stored = post_all(url, timed, CLIENTS)
        elapsed = time.monotonic() - started
        cpu = process_tree_cpu_seconds(pid) - cpu_before
    if stored != count * BATCH_ITEMS:
        raise RuntimeError(f"{stored} of {count * BATCH_ITEMS} replies stored")
    return {
        "replies": stored,
        "seconds": round(elapsed, 2),
        "rate": round(stored / elapsed),
        "receiver_cpu_seconds": round(cpu, 2),
        "receiver_cpu_us_per_reply": round(cpu * 1e6 / stored, 1),
    }


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.receiver_cpu", run, argv)


if __name__ == "__main__":
    sys.exit(main())
