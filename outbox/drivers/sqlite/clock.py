"""SQLite's clock in SQL: it has no statement time, so julianday('now') it is."""

from __future__ import annotations

DATABASE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
"""julianday('now') in epoch seconds."""
