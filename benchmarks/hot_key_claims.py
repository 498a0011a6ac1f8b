"""A relay's claim behind one long ordering key, on PostgreSQL and MariaDB.

Run: .venv/bin/python -m benchmarks.hot_key_claims

For each backend and backlog: a fresh database holding BACKLOG pending messages of one
key (all but the first held behind it) and 200 unkeyed pending messages due after them,
then CLAIMS claims of 20 through the backend's driver, each in its own transaction with
a new owner (the one key's first message stays leased, so every later claim passes the
key and takes unkeyed messages). Prints each claim's milliseconds (the first pays for
cold caches): how a claim's cost grows with one key's backlog.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import sqlalchemy as sa

import outbox
from benchmarks.databases import analyze, fresh_mysql_database
from benchmarks.relay_bench import fresh_database
from outbox.canonical import sha256_hex
from outbox.drivers import DRIVERS
from outbox.schema import messages

BACKLOGS = (1_000, 20_000)
UNKEYED = 200
CLAIMS = 5
LIMIT = 20


def row(reply_id: str, key: str | None, due: float) -> dict[str, object]:
    """One pending message of destination `orders`."""
    body = b'{"n":1}'
    return {
        "reply_id": reply_id,
        "destination": "orders",
        "ordering_key": key,
        "body": body,
        "content_hash": sha256_hex(body),
        "headers": "{}",
        "state": "pending",
        "attempts": 0,
        "available_at": due,
        "fence": 0,
        "created_at": 1.0,
    }


def claim_ms(url: str, backend: str, backlog: int) -> list[float]:
    """Each claim's milliseconds behind `backlog` messages of one key."""
    engine = outbox.create_engine(url)
    driver = DRIVERS[backend]
    try:
        rows = [row(f"k-{n}", "hot", 1.0) for n in range(backlog)]
        rows += [row(f"u-{n}", None, 2.0) for n in range(UNKEYED)]
        with engine.begin() as conn:
            for start in range(0, len(rows), 5_000):
                conn.execute(sa.insert(messages), rows[start : start + 5_000])
        analyze(engine, "outbox_messages")
        spent = []
        for n in range(CLAIMS):
            with engine.begin() as conn:
                started = time.perf_counter()
                driver.claim_messages(
                    conn,
                    owner=f"relay-{n}",
                    now=10.0,
                    lease=30.0,
                    limit=LIMIT,
                    budget=3,
                    destinations=["orders"],
                )
                spent.append((time.perf_counter() - started) * 1000)
        return spent
    finally:
        engine.dispose()


def main() -> None:
    """Print each backend's claims behind each backlog."""
    databases: dict[str, Callable[[], AbstractContextManager[str]]] = {
        "postgresql": fresh_database,
        "mysql": fresh_mysql_database,
    }
    for backend, fresh in databases.items():
        for backlog in BACKLOGS:
            with fresh() as url:
                spent = claim_ms(url, backend, backlog)
            shown = ", ".join(f"{ms:.1f}" for ms in spent)
            print(f"{backend}: behind {backlog:,} of one key: {shown} ms", flush=True)


if __name__ == "__main__":
    main()
