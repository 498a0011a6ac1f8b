"""A private NATS server killed and restarted while the relay drains into its stream.

The relay runs in-process against a `nats-server -js` of this test's own; the
server is SIGKILLed after some messages are stored and before all are, then
started again on the same port and store. Every message must end `sent` and
the stream must hold each reply_id exactly once, with its exact body: the
publishes lost with the connection come back as retries, and the ones the
stream had stored before the kill are dropped as duplicates when resent.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.cli_helpers import running_in_thread
from support.nats_helpers import Stream, new_stream, private_nats, with_jetstream
from support.receiver_helpers import wait_until
from support.relay_helpers import SECRET, rows

import outbox
from outbox.schema import messages
from relay import Relay, make_destination

TOTAL = 3000


def stored_count(stream: Stream) -> int:
    """How many messages the stream holds now; -1 while the server does not answer."""

    async def count(js: Any) -> int:
        info = await js.stream_info(stream.name)
        return int(info.state.messages)

    try:
        return with_jetstream(stream.url, count)
    except Exception:  # down or restarting: not a count
        return -1


def state_counts(engine: sa.Engine) -> dict[str, int]:
    """Rows per state."""
    with engine.connect() as conn:
        query = sa.select(messages.c.state, sa.func.count()).group_by(messages.c.state)
        return {str(row[0]): int(row[1]) for row in conn.execute(query)}


def retried(engine: sa.Engine) -> bool:
    """Whether some message is waiting for another attempt after a failed one."""
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(
            messages.c.state == "pending", messages.c.last_error.is_not(None)
        )
        return bool(conn.execute(query).scalar_one())


def test_a_nats_server_killed_mid_drain_loses_nothing_and_stores_each_reply_once(
    tmp_path: Path, db_url: str
) -> None:
    engine = outbox.create_engine(db_url)
    try:
        drain_through_a_restart(tmp_path, engine)
    finally:
        engine.dispose()


def drain_through_a_restart(tmp_path: Path, engine: sa.Engine) -> None:
    """Drain TOTAL messages while the server is killed and restarted; check the stream."""
    with private_nats(tmp_path) as server:
        stream = new_stream(server.url)
        stream.create()
        with Session(engine) as session, session.begin():
            for n in range(TOTAL):
                outbox.publish(session, "default", f"r-{n}", {"n": n})
        destination = make_destination(
            server.url,
            kind="nats",
            stream=stream.name,
            subject=f"{stream.prefix}.{{ordering_key}}",
            secret=SECRET,
            timeout=1,
            max_batch_items=20,
        )
        relay = Relay(
            engine,
            {"default": destination},
            lease=5,
            backoff=0.05,
            backoff_cap=0.2,
            max_attempts=100,
            batch=50,
            poll_interval=0.05,
        )
        try:
            with running_in_thread(relay):
                wait_until(lambda: stored_count(stream) >= 50, 30, "the first stored messages")
                server.kill()
                assert state_counts(engine).get("sent", 0) < TOTAL, "drained before the kill"
                wait_until(lambda: retried(engine), 30, "a retry while the server is down")
                server.start()
                wait_until(
                    lambda: state_counts(engine) == {"sent": TOTAL}, 120, "every message sent"
                )
        finally:
            relay.close()
        stored = stream.stored()
        ids = Counter(m.headers["webhook-id"] for m in stored)
        assert len(ids) == TOTAL
        assert [i for i, seen in ids.items() if seen > 1] == []
        saved = rows(engine)
        assert any(row["attempts"] > 1 for row in saved.values()), "nothing was resent"
        bodies = {r: bytes(row["body"]) for r, row in saved.items()}
        assert all(m.data == bodies[m.headers["webhook-id"]] for m in stored)
        stream.delete()
