"""Network faults between the relay and the reference receiver, through a fault proxy.

The relay runs in-process; the receiver is a real process behind
`faults.proxy.FaultProxy`, which loses ACKs, resets connections mid-body,
trickles answers or hangs. Every scenario switches the proxy back to `pass`,
drains, and runs the shared invariant checker. Leases and backoff run on a
manual clock where the relay is driven turn by turn; real time is spent only
where the network needs it (timeouts), and waits are polls with a deadline.

One receiver process per backend serves the whole module, since starting one
costs seconds: on PostgreSQL it writes to db_url's database (emptied before
each test), on SQLite to a file of its own (emptied here), because db_url is
a new file per test.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from support.cli_helpers import running_in_thread
from support.receiver_helpers import SECRET, ReceiverProcess, count_effects, stored_receipts
from support.relay_helpers import publish_many, rows

import outbox
from faults import figures
from faults.invariants import Tally, drain
from faults.proxy import Connection, Exchange, FaultProxy, Mode
from outbox.receiver_tables import effects, receipts
from outbox.testing import ManualClock
from relay import Destination, Relay, make_destination

TIMEOUT = 1.0  # each destination's whole-attempt timeout
BACKOFF, BACKOFF_CAP = 0.1, 0.3
ATTEMPTS = 8  # enough that no scenario here spends its budget: none may go dead
LEASE = 5.0
# The hung destination beside a healthy one: every healthy reply must be sent inside one
# hung attempt, and a loaded machine needs room for that (up to ~0.8 s seen under load).
HUNG_TIMEOUT = 6.0
WAIT = 60.0  # for what the relay or the proxy does next, however busy the machine
ROOMY_TIMEOUT = LEASE - 1  # for attempts that must end by the fault, not by a timeout
# A relay's attempt starts only if it can end inside the lease (less half a second) from
# the claim's start: a roomy attempt under LEASE left half a second for a new relay's
# first claim (its connections, announcement and sample), which a loaded machine took
# more than, and the attempt was never made (the turn's verdicts a retry all the same).
ROOMY_LEASE = ROOMY_TIMEOUT + 5


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


@dataclass(frozen=True)
class Receiver:
    """A reference receiver process and the database it writes its receipts to."""

    url: str
    process: ReceiverProcess


@pytest.fixture(scope="module")
def receivers() -> Iterator[dict[str, Receiver]]:
    """One receiver process per backend, shared by this module: each start costs seconds."""
    started: dict[str, Receiver] = {}
    yield started
    for receiver in started.values():
        receiver.process.stop()


@pytest.fixture
def receiver(
    backend: str,
    db_url: str,
    receivers: dict[str, Receiver],
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Receiver:
    """The backend's receiver, healthy and holding no receipts."""
    if backend not in receivers:
        if backend == "postgresql":
            # The run's database: db_url truncates the receiver tables before every test.
            url = db_url
        else:
            # db_url is a new file per test; the receiver keeps one of its own, emptied below.
            path = tmp_path_factory.mktemp("receiver") / "receiver.db"
            shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
            url = f"sqlite:///{path}"
        secret_file = tmp_path_factory.mktemp("secrets") / "secrets"
        secret_file.write_text(SECRET + "\n", encoding="utf-8")
        receivers[backend] = Receiver(url, ReceiverProcess(url, secret_file))
    found = receivers[backend]
    found.process.wait_ready()
    if found.url != db_url:
        engine = outbox.create_engine(found.url)
        try:
            with engine.begin() as conn:
                conn.execute(sa.delete(effects))
                conn.execute(sa.delete(receipts))
        finally:
            engine.dispose()
    return found


@pytest.fixture
def proxy(receiver: Receiver) -> Iterator[FaultProxy]:
    """A fault proxy in front of the receiver, passing until told otherwise."""
    with FaultProxy("127.0.0.1", receiver.process.port) as running:
        yield running


def to(base: str, timeout: float = TIMEOUT) -> Destination:
    """A signed destination at `base`, by default with the short attempt timeout."""
    return make_destination(base + "/replies", secret=SECRET, timeout=timeout)


def turn_by_turn(
    db_url: str,
    proxy: FaultProxy,
    clock: ManualClock,
    timeout: float = TIMEOUT,
    lease: float = LEASE,
) -> Relay:
    """A relay through the proxy, driven by dispatch_once() on the manual clock."""
    return Relay(
        db_url,
        {"default": to(proxy.url, timeout)},
        clock=clock,
        lease=lease,
        backoff=BACKOFF,
        backoff_cap=BACKOFF_CAP,
        max_attempts=ATTEMPTS,
    )


def publish(
    engine: sa.Engine, prefix: str, n: int, clock: ManualClock | None, destination: str = "default"
) -> list[str]:
    """Publish `n` replies named prefix-0.. to `destination`; returns their ids."""
    ids = [f"{prefix}-{i}" for i in range(n)]
    publish_many(engine, ids, destination=destination, clock=clock)
    return ids


def verdicts(turn: Sequence[tuple[str, str]]) -> dict[str, str]:
    """A turn's verdicts by reply_id (each reply once)."""
    found = dict(turn)
    assert len(found) == len(turn), f"a reply was settled twice in one turn: {turn}"
    return found


def wait_until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll `condition` until true; fail naming `what` once `seconds` have passed."""
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds}s waiting for {what}")
        pause.wait(0.02)


def posts(proxy: FaultProxy, mode: Mode | None = None) -> list[Exchange]:
    """The deliveries the proxy saw (in `mode` when given), not health checks."""
    return [e for e in proxy.exchanges(mode) if e.method == "POST"]


def webhook_id(exchange: Exchange) -> str:
    """The reply_id a single-mode request carried (its webhook-id header)."""
    found = exchange.header("webhook-id")
    assert found is not None, exchange.head
    return found


def answer(exchange: Exchange) -> dict[str, Any]:
    """The receiver's JSON answer to a request the proxy forwarded."""
    assert exchange.response.startswith(b"HTTP/1.1 200 "), exchange.response[:200]
    document: dict[str, Any] = json.loads(exchange.response_body)
    return document


def fault_connections(proxy: FaultProxy, mode: Mode) -> list[Connection]:
    """The connections whose requests were all delivery attempts in `mode`."""
    return [
        c
        for c in proxy.connections()
        if c.exchanges and all(e.mode == mode and e.method == "POST" for e in c.exchanges)
    ]


def assert_bounded(connections: list[Connection]) -> None:
    """Every attempt was ended by the relay: the proxy never ends a hung request and
    trickles an answer for minutes, so only the attempt's own deadline ended it."""
    assert connections
    for connection in connections:
        assert connection.closed is not None, connection
        assert connection.closed_by == "client", connection


def attempts_made(db_url: str) -> int:
    """Delivery attempts recorded over every reply."""
    engine = outbox.create_engine(db_url)
    try:
        return sum(row["attempts"] for row in rows(engine).values())
    finally:
        engine.dispose()


def settle_and_record(
    db_url: str,
    receiver: Receiver,
    backend: str,
    case: str,
    published: list[str],
    kills: int,
) -> Tally:
    """Drain, record the scenario's figures, then check the invariants (no dead allowed)."""
    found = drain(db_url, receiver.url, timeout=60, published=published)
    figures.record(
        "network",
        backend,
        case,
        runs=attempts_made(db_url),
        kills=kills,
        messages=len(published),
        found=found,
    )
    found.assert_clean()
    return found


@contextmanager
def running(relay: Relay) -> Iterator[None]:
    """relay.run() on a thread; stopped, joined and closed on the way out."""
    try:
        with running_in_thread(relay):
            yield
    finally:
        relay.close()


def test_a_lost_ack_is_resent_unchanged_and_answered_as_a_duplicate(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    receiver: Receiver,
    proxy: FaultProxy,
    clock: ManualClock,
) -> None:
    """Window C: the receiver commits, the ACK is lost, the resend is a duplicate."""
    ids = publish(engine, "lost", 3, clock)
    stored = {reply_id: row["body"] for reply_id, row in rows(engine).items()}
    proxy.set_mode("lost_ack")
    # A roomy timeout: the first attempt must end by the lost ACK, never by the relay's
    # own deadline on a busy machine, or the receiver may not have committed yet.
    with turn_by_turn(db_url, proxy, clock, ROOMY_TIMEOUT, ROOMY_LEASE) as relay:
        assert verdicts(relay.dispatch_once()) == dict.fromkeys(ids, "retry")
        # The receiver commits each one; the relay heard nothing and will retry. On a busy
        # machine the relay may hear of the lost answer before the receiver's commit lands.
        wait_until(
            lambda: {i: count_effects(receiver.url, i) for i in ids} == dict.fromkeys(ids, 1),
            WAIT,
            "the receiver to commit each one",
        )
        assert {r["state"] for r in rows(engine).values()} == {"pending"}
        proxy.set_mode("pass")
        clock.advance(BACKOFF_CAP)
        assert verdicts(relay.dispatch_once()) == dict.fromkeys(ids, "sent")
    lost, resent = posts(proxy, "lost_ack"), posts(proxy, "pass")
    assert sorted(webhook_id(e) for e in lost) == ids
    assert sorted(webhook_id(e) for e in resent) == ids
    for first in lost:
        reply_id = webhook_id(first)
        [again] = [e for e in resent if webhook_id(e) == reply_id]
        assert first.body == again.body == stored[reply_id]
        assert answer(first)["duplicate"] is False  # stored, then the ACK was dropped
        assert answer(again) == {"ack": "stored", "reply_id": reply_id, "duplicate": True}
    assert {i: count_effects(receiver.url, i) for i in ids} == dict.fromkeys(ids, 1)
    settle_and_record(db_url, receiver, backend, "lost_ack", ids, proxy.count("lost_ack"))


def test_a_reset_mid_body_leaves_nothing_half_written_and_the_retry_delivers(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    receiver: Receiver,
    proxy: FaultProxy,
    clock: ManualClock,
) -> None:
    """An RST mid-body: no receipt, no effect; the resend is the first receipt."""
    ids = publish(engine, "reset", 3, clock)
    stored = {reply_id: row["body"] for reply_id, row in rows(engine).items()}
    proxy.set_mode("reset")
    with turn_by_turn(db_url, proxy, clock) as relay:
        assert verdicts(relay.dispatch_once()) == dict.fromkeys(ids, "retry")
        assert stored_receipts(receiver.url) == {}
        assert count_effects(receiver.url) == 0
        assert {r["state"] for r in rows(engine).values()} == {"pending"}
        proxy.set_mode("pass")
        clock.advance(BACKOFF_CAP)
        assert verdicts(relay.dispatch_once()) == dict.fromkeys(ids, "sent")
    cut = posts(proxy, "reset")
    assert sorted(webhook_id(e) for e in cut) == ids
    for exchange in cut:
        whole = stored[webhook_id(exchange)]
        # The upstream really saw a request cut off mid-body, not before or after it.
        assert 0 < len(exchange.body) < len(whole)
        assert whole.startswith(exchange.body)
    resent = posts(proxy, "pass")
    # Not a duplicate: the cut-off attempt had stored nothing, not even for a moment.
    assert sorted(answer(e)["duplicate"] for e in resent) == [False] * len(ids)
    assert stored_receipts(receiver.url) == stored
    settle_and_record(db_url, receiver, backend, "reset", ids, proxy.count("reset"))


@pytest.mark.parametrize("mode", ["trickle", "hang"])
def test_a_slow_or_silent_receiver_costs_one_bounded_attempt_then_a_retry(
    mode: Mode,
    backend: str,
    db_url: str,
    engine: sa.Engine,
    receiver: Receiver,
    proxy: FaultProxy,
    clock: ManualClock,
) -> None:
    """Trickled or missing answers: every attempt ends by its timeout; the row is retried."""
    ids = publish(engine, mode, 3, clock)
    proxy.set_mode(mode)
    rounds = 2

    def all_closed(expected: int) -> Callable[[], bool]:
        """Whether the proxy saw `expected` attempts in this mode, all closed by now."""

        def check() -> bool:
            """The condition itself."""
            attempts = fault_connections(proxy, mode)
            return len(attempts) == expected and all(c.closed for c in attempts)

        return check

    with turn_by_turn(db_url, proxy, clock) as relay:
        for attempt in range(1, rounds + 1):
            assert verdicts(relay.dispatch_once()) == dict.fromkeys(ids, "retry")
            expected = attempt * len(ids)
            wait_until(all_closed(expected), WAIT, f"the relay to close its {mode} connections")
            assert_bounded(fault_connections(proxy, mode))
            for row in rows(engine).values():
                assert (row["state"], row["attempts"]) == ("pending", attempt), row
                assert row["available_at"] > clock(), "a retry must wait for its backoff"
                assert row["last_error"] == f"attempt exceeded {TIMEOUT:g}s"
            clock.advance(BACKOFF_CAP)
    proxy.set_mode("pass")
    # The faults are over: a relay with room in its timeout, as a busy machine needs, sends.
    with turn_by_turn(db_url, proxy, clock, ROOMY_TIMEOUT, ROOMY_LEASE) as relay:
        clean = verdicts(relay.dispatch_once())
        # What each retry said, should one come: a timeout on a busy machine, or worse.
        said = {reply_id: row["last_error"] for reply_id, row in rows(engine).items()}
        assert clean == dict.fromkeys(ids, "sent"), said
    # A trickled answer was committed upstream first; a hung request never got there.
    duplicate = mode == "trickle"
    assert [answer(e)["duplicate"] for e in posts(proxy, "pass")] == [duplicate] * len(ids)
    settle_and_record(db_url, receiver, backend, mode, ids, proxy.count(mode))


def beside_a_hung_one(db_url: str, proxy: FaultProxy, receiver: Receiver) -> Relay:
    """A relay (real clock) for two destinations: "hung" through the proxy, "healthy" direct."""
    hung = make_destination(proxy.url + "/replies", secret=SECRET, timeout=HUNG_TIMEOUT)
    return Relay(
        db_url,
        {"hung": hung, "healthy": to(receiver.process.base)},
        lease=LEASE + HUNG_TIMEOUT,
        backoff=BACKOFF,
        backoff_cap=BACKOFF_CAP,
        max_attempts=ATTEMPTS,
        poll_interval=0.05,
    )


def all_sent(engine: sa.Engine, ids: list[str]) -> bool:
    """Whether every one of `ids` is recorded as sent."""
    states = rows(engine)
    return all(states[reply_id]["state"] == "sent" for reply_id in ids)


def hung_while_healthy_sent(
    proxy: FaultProxy, engine: sa.Engine, hung: list[str], healthy: list[str]
) -> set[int]:
    """Wait for the first hung attempts; check every healthy reply is sent before they end.

    Returns the numbers of the first hung attempts' connections, still open or not.
    """
    # The relay's start-up health check of the hung destination hangs too (a GET).
    wait_until(lambda: len(posts(proxy, "hang")) >= len(hung), WAIT, "the first hung attempts")
    first_hung = {c.number for c in fault_connections(proxy, "hang")[: len(hung)]}
    wait_until(lambda: all_sent(engine, healthy), WAIT, "the healthy replies to be sent")
    healthy_done = time.monotonic()
    for connection in proxy.connections():
        if connection.number in first_hung:
            assert connection.closed is None or connection.closed > healthy_done, (
                f"the healthy replies were all sent only {healthy_done - connection.closed:.2f}s"
                " after a hung attempt ended: they waited for it"
            )
    assert not any(rows(engine)[reply_id]["state"] == "sent" for reply_id in hung)

    def first_hung_ended() -> bool:
        """Whether the relay has closed every one of the first hung attempts."""
        ended = [c for c in proxy.connections() if c.number in first_hung and c.closed]
        return len(ended) == len(first_hung)

    # The hung replies' attempts end by their timeout, so they can be retried.
    wait_until(first_hung_ended, WAIT, "the first hung attempts to end")
    assert_bounded([c for c in proxy.connections() if c.number in first_hung])
    return first_hung


def test_a_hanging_destination_does_not_hold_up_a_healthy_one(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    proxy: FaultProxy,
    receiver: Receiver,
) -> None:
    """Healthy replies published while another destination hangs are sent during the hang."""
    proxy.set_mode("hang")
    hung = publish(engine, "hung", 3, None, destination="hung")
    healthy: list[str] = []
    with running(beside_a_hung_one(db_url, proxy, receiver)):
        wait_until(lambda: len(posts(proxy, "hang")) >= len(hung), WAIT, "the first hung attempts")
        healthy += publish(engine, "healthy", 5, None, destination="healthy")
        hung_while_healthy_sent(proxy, engine, hung, healthy)
        proxy.set_mode("pass")
        found = settle_and_record(
            db_url, receiver, backend, "hang_beside_healthy", hung + healthy, proxy.count("hang")
        )
    assert found.receipts == len(hung) + len(healthy)


def test_healthy_replies_claimed_with_hung_ones_are_not_held_up(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    proxy: FaultProxy,
    receiver: Receiver,
) -> None:
    """Claimed in one batch with replies to a hanging destination, healthy ones are sent."""
    proxy.set_mode("hang")
    hung = publish(engine, "hung", 2, None, destination="hung")
    healthy = publish(engine, "healthy", 3, None, destination="healthy")
    with running(beside_a_hung_one(db_url, proxy, receiver)):
        hung_while_healthy_sent(proxy, engine, hung, healthy)
        proxy.set_mode("pass")
        found = settle_and_record(
            db_url, receiver, backend, "hang_same_batch", hung + healthy, proxy.count("hang")
        )
    assert found.receipts == len(hung) + len(healthy)


def test_an_answer_that_arrives_in_pieces_is_read_whole(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    receiver: Receiver,
    clock: ManualClock,
) -> None:
    """A batch answer trickled fast (many segments, well within the timeout) settles each reply."""
    ids = publish(engine, "pieces", 3, clock)
    # A millisecond per byte: a few hundred segments, all in well under the timeout.
    with FaultProxy(
        "127.0.0.1", receiver.process.port, "trickle", trickle_interval=0.001
    ) as pieces:
        target = make_destination(pieces.url + "/replies", secret=SECRET, timeout=5, mode="batch")
        with Relay(
            db_url, {"default": target}, clock=clock, lease=10, max_attempts=ATTEMPTS
        ) as relay:
            turn = verdicts(relay.dispatch_once())
        [exchange] = posts(pieces, "trickle")
        errors = {reply_id: row["last_error"] for reply_id, row in rows(engine).items()}
        assert turn == dict.fromkeys(ids, "sent"), errors
        # Answers are matched by reply_id: their order is the batch's, not the ids'.
        results = json.loads(exchange.response_body)["results"]
        assert sorted(results, key=lambda r: r["reply_id"]) == [
            {"reply_id": reply_id, "status": "stored"} for reply_id in sorted(ids)
        ]
        kills = pieces.count("trickle")
    settle_and_record(db_url, receiver, backend, "trickle_fast_batch", ids, kills)
