"""Reference receiver: dedupe by reply_id and body hash, commit the effect once."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox.migrations import RECEIVER_BRANCH, upgrade_branch

__all__ = ["upgrade"]


def upgrade(url_or_engine: str | sa.URL | Engine) -> None:
    """Create or upgrade the receiver tables only (their own Alembic branch)."""
    upgrade_branch(url_or_engine, RECEIVER_BRANCH)
