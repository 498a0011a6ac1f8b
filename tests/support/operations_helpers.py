"""Helpers for tests of `outbox status|dead|purge`: seed message states, read them back."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox.schema import messages, requeues
from outbox.testing import ManualClock
from outbox_cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    """`outbox ARGV --json`, which must exit 0; its decoded output."""
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def state_rows(db_url: str) -> list[dict[str, object]]:
    """Every message's reply_id and state."""
    engine = outbox.create_engine(db_url)
    try:
        with engine.connect() as conn:
            query = sa.select(messages.c.reply_id, messages.c.state)
            return [dict(row) for row in conn.execute(query).mappings()]
    finally:
        engine.dispose()


def mark_sent(engine: sa.Engine, sent_at: dict[str, float]) -> None:
    """Seed: these messages were sent at these times."""
    with engine.begin() as conn:
        for reply_id, moment in sent_at.items():
            conn.execute(
                messages.update()
                .where(messages.c.reply_id == reply_id)
                .values(state="sent", sent_at=moment)
            )


def mark_dead(engine: sa.Engine, reply_id: str, attempts: int = 3) -> None:
    """Seed: this message died after `attempts` attempts."""
    with engine.begin() as conn:
        conn.execute(
            messages.update()
            .where(messages.c.reply_id == reply_id)
            .values(state="dead", attempts=attempts, last_status=503, last_error="HTTP 503")
        )


def audit_rows(engine: sa.Engine) -> list[dict[str, object]]:
    """The audit of decisions about dead messages, oldest first."""
    with engine.connect() as conn:
        query = sa.select(requeues).order_by(requeues.c.id)
        return [dict(row) for row in conn.execute(query).mappings()]


def dead_messages(engine: sa.Engine, clock: ManualClock) -> None:
    """Four dead messages: created an hour apart, two destinations, three kinds of error."""
    dead = [
        ("b-1", "billing", 410, "HTTP 410: gone"),
        ("b-2", "billing", 409, "HTTP 409 conflict: other body"),
        ("s-1", "shipping", 410, "HTTP 410: Gone for good"),
        ("s-2", "shipping", None, "outcome unknown: lease expired while sending"),
    ]
    for reply_id, destination, status, error in dead:
        with Session(engine) as session, session.begin():
            outbox.publish(session, destination, reply_id, {"id": reply_id}, clock=clock)
        with engine.begin() as conn:
            conn.execute(
                sa.update(messages)
                .where(messages.c.reply_id == reply_id)
                .values(state="dead", attempts=1, last_status=status, last_error=error)
            )
        clock.advance(3600)


def mark_resolved(engine: sa.Engine, resolved_at: dict[str, float]) -> None:
    """Seed: these dead messages were resolved at these times."""
    with engine.begin() as conn:
        for reply_id, moment in resolved_at.items():
            conn.execute(
                messages.update()
                .where(messages.c.reply_id == reply_id)
                .values(state="resolved", resolved_at=moment, last_error="HTTP 503")
            )
