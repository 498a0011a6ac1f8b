"""The benchmarks' MySQL or MariaDB databases, and each backend's planner statistics.

PostgreSQL's fresh databases are benchmarks.relay_bench.fresh_database's. MariaDB runs
at 127.0.0.1:3306 as root on this machine (OUTBOXDEV_BENCH_MYSQL_URL names another).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

import outbox
import receiver
from outbox.ddl import MYSQL

MYSQL_ADMIN_URL = os.environ.get(
    "OUTBOXDEV_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/mysql"
)


@contextmanager
def fresh_mysql_database() -> Iterator[str]:
    """A new MySQL or MariaDB database with both schemas, dropped afterwards."""
    admin = outbox.create_engine(MYSQL_ADMIN_URL)
    name = f"outbox_bench_{uuid.uuid4().hex[:10]}"
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        url = admin.url.set(database=name).render_as_string(hide_password=False)
        try:
            outbox.upgrade(url)
            receiver.upgrade(url)
            yield url
        finally:
            with admin.begin() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
    finally:
        admin.dispose()


def analyze(engine: sa.Engine, *tables: str) -> None:
    """Planner statistics, as autovacuum (or InnoDB's own sampling) would have them on a
    live table."""
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"ANALYZE {', '.join(tables)}")
        elif engine.dialect.name in MYSQL:
            conn.exec_driver_sql(f"ANALYZE TABLE {', '.join(tables)}").all()
        else:
            for table in tables:  # SQLite's ANALYZE takes one name
                conn.exec_driver_sql(f"ANALYZE {table}")
