"""`Relay.dispatch_once()` on its own: each destination settled apart, nothing left open."""

from __future__ import annotations

import gc
import threading
import time
import warnings

import sqlalchemy as sa
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

from outbox.testing import ManualClock
from relay import Relay, make_destination


def test_each_destinations_part_settles_without_waiting_for_the_others(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["slow-1"], destination="slow", clock=clock)
    publish_many(engine, ["fast-1"], destination="fast", clock=clock)
    release = threading.Event()
    with ScriptedServer() as slow, ScriptedServer() as fast:
        slow.script("slow-1", Answer(stall=5.0))
        destinations = {
            "slow": make_destination(slow.url, secret=SECRET, timeout=8),
            "fast": make_destination(fast.url, secret=SECRET, timeout=8),
        }
        with Relay(db_url, destinations, clock=clock, lease=10) as relay:
            verdicts: list[tuple[str, str]] = []
            turn = threading.Thread(target=lambda: verdicts.extend(relay.dispatch_once()))
            turn.start()
            deadline = time.monotonic() + 4
            # The fast destination's message is settled while the slow one still posts.
            while rows(engine)["fast-1"]["state"] != "sent" and time.monotonic() < deadline:
                release.wait(0.02)
            fast_state = rows(engine)["fast-1"]["state"]
            slow_state = rows(engine)["slow-1"]["state"]
            turn.join(timeout=15)
    assert (fast_state, slow_state) == ("sent", "sending")
    assert sorted(verdicts) == [("fast-1", "sent"), ("slow-1", "sent")]


def test_a_relay_used_through_dispatch_once_leaves_no_http_session_open(
    db_url: str, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["s-1"], clock=clock)
    with warnings.catch_warnings(record=True) as caught, ScriptedServer() as server:
        warnings.simplefilter("always")
        with Relay(
            db_url, {"default": make_destination(server.url, secret=SECRET)}, clock=clock
        ) as r:
            assert r.dispatch_once() == [("s-1", "sent")]
        del r
        gc.collect()
    unclosed = [str(w.message) for w in caught if "nclosed" in str(w.message)]
    assert unclosed == []
