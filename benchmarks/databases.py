"""The benchmarks' MySQL or MariaDB databases, and each backend's planner statistics.

PostgreSQL's fresh databases are benchmarks.relay_bench.fresh_database's. MariaDB runs
at 127.0.0.1:3306 as root on this machine (OUTBOXDEV_BENCH_MYSQL_URL names another).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import sqlalchemy as sa

import outbox
import receiver
from outbox.ddl import MYSQL

MYSQL_ADMIN_URL = os.environ.get(
    "OUTBOXDEV_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/mysql"
)


@contextmanager
def migrated_database(admin_url: str, create: str, drop: str) -> Iterator[str]:
    """A new database with both schemas, made by `create` and dropped afterwards by `drop`
    (statements naming it `{name}`) on the server of `admin_url`."""
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"outbox_bench_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(create.format(name=name)))
        url = admin.url.set(database=name).render_as_string(hide_password=False)
        try:
            outbox.upgrade(url)
            receiver.upgrade(url)
            yield url
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(drop.format(name=name)))
    finally:
        admin.dispose()


def fresh_mysql_database() -> AbstractContextManager[str]:
    """A new MySQL or MariaDB database with both schemas, dropped afterwards."""
    return migrated_database(
        MYSQL_ADMIN_URL,
        "CREATE DATABASE `{name}` CHARACTER SET utf8mb4",
        "DROP DATABASE IF EXISTS `{name}`",
    )


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
