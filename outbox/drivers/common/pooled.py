"""Task claims and finishes through the pool, for a backend with no held-connection client."""

from __future__ import annotations

from sqlalchemy.engine import Engine


class PooledTaskConnections:
    """No held connection (SQLite's one writer, MySQL's PyMySQL): claims and batches of
    finished tasks take a pooled connection each time."""

    def held_task_claims(self, engine: Engine, owns_engine: bool) -> None:
        """None: claims go through the pool."""
        return

    def held_task_finishes(self, engine: Engine, owns_engine: bool) -> None:
        """None: batches of finished tasks go through the pool, as claims."""
        return
