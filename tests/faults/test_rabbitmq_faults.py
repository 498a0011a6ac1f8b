"""RabbitMQ destinations under faults: connections cut mid-drain, a relay killed mid-settle.

RabbitMQ does not dedupe, so a resend after a lost confirm may queue a reply
twice: at-least-once into the queue. What these tests hold the relay to is
that nothing is lost: every reply is in the queue, every row ends sent. The
duplicates are counted (and printed), not forbidden: the
consumer's dedupe makes their effects once, which test_broker_crashes.py and
test_broker_outages.py prove with a consumer process and the invariant checker.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.cli_helpers import running_in_thread
from support.rabbitmq import AMQP_URL, take_all, topology
from support.relay_helpers import SECRET, publish_many

import outbox
from faults.nodes import Node
from faults.stream_proxy import StreamProxy
from outbox.schema import messages
from relay import Relay, make_destination

sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll `condition()` every 50 ms; fail naming `what` when the deadline passes first."""
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:g}s waiting for {what}")
        pause.wait(0.05)


def states(engine: sa.Engine) -> Counter[str]:
    """How many messages are in each state."""
    with engine.connect() as conn:
        return Counter(
            dict(
                conn.execute(
                    sa.select(messages.c.state, sa.func.count()).group_by(messages.c.state)
                ).all()
            )
        )


def all_sent(engine: sa.Engine, count: int) -> Callable[[], bool]:
    """Whether all `count` messages are sent."""
    return lambda: states(engine)["sent"] == count


@sqlite_only
def test_connections_cut_mid_drain_lose_nothing(
    db_url: str,
) -> None:
    ids = [f"cut-{n}" for n in range(300)]
    engine = outbox.create_engine(db_url)
    publish_many(engine, ids, ordering_key=None)
    host, port = "127.0.0.1", int(AMQP_URL.rsplit(":", 1)[1].strip("/"))
    with topology() as made, StreamProxy(host, port) as proxy:
        destination = make_destination(
            f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
            kind="rabbitmq",
            exchange=made.exchange,
            routing_key="replies",
            secret=SECRET,
            timeout=2,
            max_batch_items=25,
        )
        # About 500 bytes go upstream per message: three cuts well inside the drain.
        proxy.cut_every(30_000, times=3)
        relay = Relay(
            db_url,
            {"default": destination},
            backoff=0.05,
            backoff_cap=0.2,
            max_attempts=100,
            batch=50,
            poll_interval=0.05,
        )
        try:
            with running_in_thread(relay):
                wait_for(all_sent(engine, len(ids)), 90, "every reply to be sent")
        finally:
            relay.close()
        queued = Counter(m.message_id for m in take_all(made.queue))
    final = states(engine)
    engine.dispose()
    assert final == Counter({"sent": len(ids)})
    assert proxy.cuts == 3
    assert proxy.accepted >= 4  # the first connection and one after each cut
    assert set(queued) == set(ids), f"lost: {sorted(set(ids) - set(queued))[:10]}"
    duplicates = sum(queued.values()) - len(ids)
    print(f"{len(ids)} replies, {duplicates} duplicates in the queue")


@sqlite_only
def test_a_relay_killed_after_the_confirms_and_before_the_sent_commit_loses_nothing(
    db_url: str, tmp_path: Path
) -> None:
    ids = [f"kill-{n}" for n in range(30)]
    engine = outbox.create_engine(db_url)
    publish_many(engine, ids)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    with topology() as made:
        config = tmp_path / "outbox.toml"
        config.write_text(
            "\n".join(
                [
                    f'db = "{db_url}"',
                    "[relay]",
                    "lease = 3",
                    "poll_interval = 0.1",
                    "backoff = 0.05",
                    "backoff_cap = 0.3",
                    "batch = 10",
                    "[destinations.default]",
                    'kind = "rabbitmq"',
                    f'url = "{AMQP_URL}"',
                    f'exchange = "{made.exchange}"',
                    'routing_key = "replies"',
                    f'secret_file = "{secret_file}"',
                    "timeout = 2",
                    "",
                ]
            ),
            encoding="utf-8",
        )

        def relay(name: str, failpoint: str | None) -> Node:
            argv = ["relay", "--config", str(config), "--owner", name]
            return Node(name, "faults.work:cli", [argv], tmp_path / f"{name}.log", failpoint)

        killed = relay("relay-1", "relay.before_sent_commit")
        killed.wait(60)
        assert killed.died_at_failpoint(), f"exit {killed.exitcode}\n{killed.tail()}"
        after_kill = Counter(m.message_id for m in take_all(made.queue))
        # Confirmed by the broker, not yet recorded as sent when the relay died.
        assert after_kill, "the killed relay published nothing"
        assert states(engine)["sent"] < len(ids)
        survivor = relay("relay-2", None)
        try:
            wait_for(all_sent(engine, len(ids)), 60, "the second relay to send everything")
        finally:
            survivor.stop()
        queued = after_kill + Counter(m.message_id for m in take_all(made.queue))
    engine.dispose()
    assert set(queued) == set(ids), f"lost: {sorted(set(ids) - set(queued))[:10]}"
    duplicates = sum(queued.values()) - len(ids)
    # The turn that died had its confirms: the survivor published those replies again.
    assert duplicates >= 1
    print(f"{len(ids)} replies, {duplicates} duplicates in the queue")
