"""What the test run knows of its surroundings: whether it is CI, and the tables it empties.

In a module of its own: a test that did `from conftest import ...` got whichever
conftest.py was imported last under that name.
"""

from __future__ import annotations

import os

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


def emptying_statements(backend: str) -> list[str]:
    """The SQL that empties every table and restarts the ids, as a fresh database has them.

    DELETE, not TRUNCATE, on PostgreSQL too: the tables hold a few rows between tests,
    and TRUNCATE's new files and their sync at commit cost ten times as much, on a
    server the whole suite shares. SQLite tests start from a fresh copy of a migrated
    file, so their ids need no restart.
    """
    statements = [f"DELETE FROM {table}" for table in ALL_TABLES]
    if backend == "postgresql":
        statements += [
            f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), 1, false)"
            for table in SERIAL_TABLES
        ]
    if backend == "mysql":
        statements += [f"ALTER TABLE {table} AUTO_INCREMENT = 1" for table in SERIAL_TABLES]
    return statements
