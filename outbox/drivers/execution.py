"""Execution options the toolkit's engines honour (installed by outbox.db.dialect)."""

from __future__ import annotations

UNPREPARED = "outbox_unprepared"
"""Execution option: plan this statement for its actual parameters every time (PostgreSQL)."""
