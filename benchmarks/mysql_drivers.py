"""The MySQL drivers measured against each other, for docs/reference/dependencies.md.

Run (the drivers not in the development install go to a folder of their own):

    apt-get install -y libmariadb-dev         # mysqlclient's build needs the client headers
    .venv/bin/pip install --target /tmp/mysql-sync mysqlclient
    .venv/bin/pip install --target /tmp/mysql-async aiomysql==0.3.2 pymysql==1.1.1
    PYTHONPATH=.:/tmp/mysql-sync .venv/bin/python -m benchmarks.mysql_drivers sync
    PYTHONPATH=.:/tmp/mysql-async .venv/bin/python -m benchmarks.mysql_drivers async

sync: PyMySQL against mysqlclient (two relays draining 20,000 messages, publish() per
transaction beside a bare INSERT, the client's CPU to read a row); async: asyncmy
against aiomysql (outbox.asyncio.publish() per transaction, the client's CPU to read a
row). Each on a fresh MariaDB database, the drivers' order alternated between rounds.
"""

from __future__ import annotations

import asyncio
import sys
import time

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import outbox
import outbox.asyncio
from benchmarks.databases import fresh_mysql_database
from benchmarks.relay_bench import drain_backlog, prefill
from benchmarks.suite import complete_rate, publish_overhead

ROUNDS = 2
DRAINED = 20_000
TRANSACTIONS = 1_000
READ_ROWS = 1_000
READS = 30


def on(url: str, driver: str) -> str:
    """`url` through `driver`."""
    return sa.make_url(url).set(drivername=driver).render_as_string(hide_password=False)


def read_cpu_us(url: str) -> float:
    """The client's CPU per row of a read of READ_ROWS message rows."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.text("SELECT * FROM outbox_messages")
            conn.execute(query).all()
            started = time.process_time()
            for _ in range(READS):
                conn.execute(query).all()
            return (time.process_time() - started) / READS / READ_ROWS * 1e6
    finally:
        engine.dispose()


def sync_round(driver: str) -> str:
    """One round of the sync figures through `driver`."""
    with fresh_mysql_database() as url:
        prefill(url, DRAINED)
        rate = complete_rate(drain_backlog(on(url, driver), DRAINED, "batch", 2, 1000, 1))
    with fresh_mysql_database() as url:
        publish = publish_overhead(on(url, driver), TRANSACTIONS)
    with fresh_mysql_database() as url:
        prefill(url, READ_ROWS)
        read = read_cpu_us(on(url, driver))
    return (
        f"drain {rate:,.0f}/s; publish {publish['ours']:,.0f} us "
        f"(bare {publish['baseline']:,.0f} us); read {read:.1f} us CPU/row"
    )


async def async_figures(url: str) -> tuple[float, float]:
    """outbox.asyncio.publish() per transaction (us), then the client's CPU per row read."""
    engine = create_async_engine(url)
    try:
        async with AsyncSession(engine) as session:
            for n in range(-50, 0):  # warm the pool and the statement cache
                async with session.begin():
                    await outbox.asyncio.publish(session, "default", f"warm{n}", {"n": n})
            started = time.perf_counter()
            for n in range(TRANSACTIONS):
                async with session.begin():
                    await outbox.asyncio.publish(session, "default", f"pub{n}", {"n": n})
            publish = (time.perf_counter() - started) / TRANSACTIONS * 1e6
        async with engine.connect() as conn:
            query = sa.text("SELECT * FROM outbox_messages")
            rows = len((await conn.execute(query)).all())
            started = time.process_time()
            for _ in range(READS):
                (await conn.execute(query)).all()
            read = (time.process_time() - started) / READS / rows * 1e6
    finally:
        await engine.dispose()
    return publish, read


def async_round(driver: str) -> str:
    """One round of the async figures through `driver`."""
    with fresh_mysql_database() as url:
        prefill(url, READ_ROWS)
        publish, read = asyncio.run(async_figures(on(url, driver)))
    return f"publish {publish:,.0f} us; read {read:.1f} us CPU/row"


def main(kind: str) -> None:
    """Print each driver's figures, round by round."""
    drivers, measure = {
        "sync": (["mysql+pymysql", "mysql+mysqldb"], sync_round),
        "async": (["mysql+asyncmy", "mysql+aiomysql"], async_round),
    }[kind]
    for round_ in range(ROUNDS):
        for driver in drivers if round_ % 2 == 0 else drivers[::-1]:
            print(f"{driver}: {measure(driver)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sync")
