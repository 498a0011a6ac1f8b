"""Execution options the toolkit's engines honour (installed by each driver's prepare_engine)."""

from __future__ import annotations

UNPREPARED = "outbox_unprepared"
"""Execution option: plan this statement for its actual parameters every time (PostgreSQL)."""
BINARY_ROWS = "outbox_binary_rows"
"""Execution option: the server sends this statement's rows in binary (PostgreSQL)."""
READ_ONLY = "outbox_read_only"
"""Execution option: this connection only reads (SQLite begins it deferred, not IMMEDIATE)."""
