"""Rows per state as PostgreSQL's statistics estimate them: what the console's overview
shows of the final states once a table is too large to count at each refresh."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox.drivers.base import StateTable
from outbox.drivers.common.operations import STATE_TABLES

STATE_STATISTICS = sa.text(
    "SELECT c.reltuples, c.relpages, "
    "pg_relation_size(c.oid) / current_setting('block_size')::int AS pages, "
    "s.most_common_vals::text::text[] AS states, s.most_common_freqs AS shares "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "LEFT JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = c.relname "
    "AND s.attname = 'state' "
    "WHERE c.oid = to_regclass(:table)"
)
"""The table's row count and pages at its last ANALYZE, its pages now, and the share of
each common state then."""


class PostgreSQLEstimates:
    """Estimated rows per state, from pg_class and pg_stats, as the planner estimates them."""

    def state_estimates(self, conn: Connection, table: StateTable) -> dict[str, int] | None:
        """Rows per state estimated from the statistics, scaled to the table's size now, as
        the planner scales them; None before the table's first ANALYZE."""
        row: Any = conn.execute(STATE_STATISTICS, {"table": STATE_TABLES[table].name}).first()
        if row is None or row.reltuples < 0 or not row.relpages or row.states is None:
            return None
        rows_now = row.reltuples / row.relpages * row.pages
        return {
            state: round(share * rows_now)
            for state, share in zip(row.states, row.shares, strict=True)
        }
