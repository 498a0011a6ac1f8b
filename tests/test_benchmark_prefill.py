"""The benchmarks' COPY prefill writes the rows their INSERTs write, byte for byte.

Every timed drain on PostgreSQL starts from a backlog written by COPY
(benchmarks.relay_bench.copy_rows); the rows must be those publish() stores, as
the INSERTs still used on SQLite and MySQL write them.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from benchmarks.relay_bench import copy_rows, creation_headers, pending_row
from outbox.schema import messages

# What COPY's text format must escape, in every column it could reach.
AWKWARD_BODY = b'{"n":1}\x00\\\t\r\n\xff'
AWKWARD_HEADERS = '{"x-note":"tab\\tand\\\\backslash"}'


def rows() -> list[dict[str, Any]]:
    """Rows with each kind of value a prefill writes, and values COPY must escape."""
    written = [
        pending_row("plain", b'{"kind":"result"}'),
        pending_row("awkward", AWKWARD_BODY, headers=AWKWARD_HEADERS),
        pending_row("traced", b"{}", headers=creation_headers(7)),
        pending_row("keyed", b"{}", available_at=1_796_000_000.123456, ordering_key="k\t1"),
        pending_row("elsewhere", b"{}", destination="billing"),
    ]
    for n, row in enumerate(written):
        row["created_at"] = 1_796_000_000.5 + n  # the two writes compare equal
    return written


def stored(conn: sa.Connection) -> list[tuple[Any, ...]]:
    """Every column of every stored message but its id, in id order."""
    columns = [column for column in messages.c if column.name != "id"]
    return [tuple(row) for row in conn.execute(sa.select(*columns).order_by(messages.c.id))]


def test_the_copy_prefill_stores_what_the_inserts_store(pg_psycopg_url: str) -> None:
    engine = sa.create_engine(pg_psycopg_url)
    try:
        with engine.begin() as conn:
            copy_rows(conn, [])
            nothing = stored(conn)
            copy_rows(conn, rows())
        with engine.begin() as conn:
            copied = stored(conn)
            conn.execute(sa.delete(messages))
            conn.execute(sa.insert(messages), rows())
        with engine.connect() as conn:
            inserted = stored(conn)
    finally:
        engine.dispose()
    assert nothing == []
    assert [row[0] for row in copied] == ["plain", "awkward", "traced", "keyed", "elsewhere"]
    assert copied == inserted
