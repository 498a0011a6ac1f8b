"""Database faults for tests: sessions killed under a running component."""

from __future__ import annotations

import sqlalchemy as sa

import outbox


def terminate_other_sessions(db_url: str) -> int:
    """Kill every other session on the test database (PostgreSQL), as a restart would."""
    admin = outbox.create_engine(db_url)
    try:
        with admin.connect() as conn:
            return len(
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).all()
            )
    finally:
        admin.dispose()
