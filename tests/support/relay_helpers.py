"""Helpers for relay tests: publish messages and read them back."""

from __future__ import annotations

import base64
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox.schema import messages

SECRET = "whsec_" + base64.b64encode(b"relay-test-secret-0123456789").decode()


def publish_many(
    engine: sa.Engine,
    ids: list[str],
    destination: str = "default",
    ordering_key: str | None = None,
    clock: Any = None,
) -> None:
    """Publish one message per id, each in its own transaction (commit order = id order)."""
    for reply_id in ids:
        with Session(engine) as session, session.begin():
            outbox.publish(
                session,
                destination,
                reply_id,
                {"id": reply_id},
                ordering_key=ordering_key,
                clock=clock,
            )


def rows(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    """Every message row by reply_id."""
    with engine.connect() as conn:
        return {
            r["reply_id"]: dict(r)
            for r in conn.execute(sa.select(messages).order_by(messages.c.id)).mappings()
        }
