"""MySQL's clock in SQL: the statement's start time in epoch seconds, microseconds kept."""

from __future__ import annotations

DATABASE_NOW = "(UNIX_TIMESTAMP(NOW(6)) + 0e0)"
"""NOW(6) as epoch seconds: stable within a statement, as PostgreSQL's statement time is;
`+ 0e0` makes UNIX_TIMESTAMP's DECIMAL a DOUBLE, the type every stored time has."""
