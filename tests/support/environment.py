"""What the test run knows of its surroundings: whether it is CI, and the tables it empties.

In a module of its own: a test that did `from conftest import ...` got whichever
conftest.py was imported last under that name.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
"""Under CI a missing service or tool fails the run instead of skipping."""
ALL_TABLES = (
    "outbox_inbox",
    "outbox_tasks",
    "outbox_messages",
    "outbox_requeues",
    "outbox_relays",
    "outbox_workers",
    "outbox_task_decisions",
    "outbox_failed_attempts",
    "outbox_backlog_samples",
    "receiver_receipts",
    "receiver_effects",
    "receiver_dead_letters",
)
"""Every table the migrations create, emptied between tests."""
SERIAL_TABLES = (
    "outbox_messages",
    "outbox_requeues",
    "outbox_task_decisions",
    "outbox_failed_attempts",
    "receiver_effects",
)
"""The tables whose `id` a sequence numbers: restarted at 1 with the emptying."""
EMPTYING_SESSION = "outbox-tests-emptying"
"""The application_name of the PostgreSQL session the tests' emptying keeps open, which
the tests that kill a component's sessions leave alone and out of their count."""


def empty_tables(conn: sa.Connection, backend: str) -> None:
    """Empty every table and restart the ids, as a fresh database has them.

    DELETE, not TRUNCATE, on PostgreSQL too: the tables hold a few rows between tests,
    and TRUNCATE's new files and their sync at commit cost ten times as much, on a
    server the whole suite shares. On MySQL a counter is reset only where it moved: each
    reset is a DDL statement with its own commit (16 ms of the 18 an emptying took).
    SQLite tests start from a fresh copy of a migrated file, so their ids need no restart.
    """
    for table in ALL_TABLES:
        conn.execute(sa.text(f"DELETE FROM {table}"))
    if backend == "postgresql":
        for table in SERIAL_TABLES:
            conn.execute(
                sa.text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), 1, false)")
            )
    if backend == "mysql":
        for table in moved_counters(conn):
            conn.execute(sa.text(f"ALTER TABLE {table} AUTO_INCREMENT = 1"))


def moved_counters(conn: sa.Connection) -> list[str]:
    """The SERIAL_TABLES of this MySQL database whose next id is past 1."""
    if not conn.dialect.is_mariadb:
        # MySQL 8 answers information_schema from statistics cached for a day by default.
        conn.execute(sa.text("SET SESSION information_schema_stats_expiry = 0"))
    moved = conn.execute(
        sa.text(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() "
            "AND auto_increment > 1 AND table_name IN :tables"
        ).bindparams(sa.bindparam("tables", expanding=True)),
        {"tables": list(SERIAL_TABLES)},
    )
    return sorted(moved.scalars())
