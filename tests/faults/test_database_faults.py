"""Database faults: sessions killed (PostgreSQL), and the server crashed (PostgreSQL and
MariaDB), under a running system.

Real worker, relay and receiver processes (faults.system.System) carry tasks and
published replies while the database goes away under them:

- terminated sessions: on the run's test database of the shared server,
  `pg_terminate_backend` ends every session of the workers, the relays and
  the receiver (found by application_name, which each node sets to its own
  name), several times while work flows;
- a crash restart: a server owned by the test, never the shared one, crashed and
  started again several times while work flows: a PostgreSQL cluster
  (faults.pg_cluster) restarted in immediate mode (no checkpoint, crash recovery on
  start), a MariaDB server (faults.mariadb_server) killed with SIGKILL (InnoDB's crash
  recovery on start).

Work enters through a `Feeder` thread in the test process, as clients would
send it: each task through intake, replies through publish() in batches, each
sent again after a database error until it is acknowledged (both are
idempotent, so a resend after an unknown outcome is safe). Each fault is
injected once the feeder has sent its share of the work, so every fault hits
a system with work arriving and in flight, however fast the machine is.

After the last fault the system must settle within `SETTLE_WITHIN` seconds,
counted from the fault: every reply sent (or dead with its reason recorded),
every task done, the invariant checker finding nothing lost, duplicated,
stuck or unexpected, and every process still the one that started (they
reconnect and retry; none exits). A COMMIT cut off by the fault has an
unknown outcome, which the product must resolve by reading the row again; a
wrong guess shows up here as a lost, stuck or duplicated reply.

One wrong guess these runs provoke is hidden from the invariant checker,
because the receiver deduplicates what it causes: a relay whose claim failed
re-leases every row it holds as "sending", including those of its own turns
still in flight, and sends them a second time (the in-flight turn's outcome is
then refused as "taken over"). The last test pins it down with one relay and a
destination that holds a POST; it fails until the relay is fixed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.cli_helpers import running_in_thread
from support.environment import IN_CI
from support.receiver_helpers import wait_until
from support.relay_helpers import SECRET, publish_many, rows
from support.scripted_server import Answer, ScriptedServer

import outbox
import receiver
from faults.figures import record_then_assert
from faults.invariants import Tally
from faults.mariadb_server import MariaDBServer
from faults.mariadb_server import find_bin as find_mariadb_bin
from faults.nodes import Node
from faults.pg_cluster import PgCluster, find_bin
from faults.system import System
from faults.work import SENDER, envelope
from outbox import AuthContext, TaskQueue
from relay import Relay, make_destination

SETTLE_WITHIN = 60.0  # seconds from the last fault until everything has settled
RESEND_FOR = 30.0  # seconds a feeder keeps resending one item before it gives up
RESEND_PAUSE = 0.05  # seconds between resends while the database is away
WORKERS = RELAYS = 2
WORKER_CONCURRENCY = 4

# Terminated sessions: the relays post one reply per request (single mode).
SESSION_TASKS = 500
SESSION_PUBLISHED = 50
SESSION_ROUNDS = 5

# Crash restarts: 2,000 replies, most of them published (a task costs about 20 ms of
# CPU on these 2-core machines, a published reply far less); relays post in batches.
RESTART_TASKS = 400
RESTART_PUBLISHED = 1600
RESTARTS = 3
RELAY_BATCH = 50

TASKS_PER_STEP = 10  # the feeder publishes its share of replies after every 10 tasks


class Feeder(threading.Thread):
    """A client in the test process: sends tasks and published replies until all are ACKed."""

    def __init__(self, system: System, tasks: int, published: int) -> None:
        """Plan `tasks` intakes and `published` replies, interleaved; start() runs them."""
        super().__init__(name="feeder", daemon=True)
        self.system = system
        self.task_ids = system.new_ids("m", tasks)
        self.reply_ids = system.new_ids("pub", published)
        self.total = tasks + published
        self.fed = 0  # items acknowledged so far (only this thread writes it)
        self.resends = 0
        self.error: BaseException | None = None
        self._queue = TaskQueue(system.db_url, allowed_sources=(SENDER,))

    def run(self) -> None:
        """Feed everything, remembering the first error for `finish()`."""
        try:
            steps = max(1, len(self.task_ids) // TASKS_PER_STEP)
            share = -(-len(self.reply_ids) // steps)  # ceiling: every reply finds a step
            for step in range(steps):
                tasks = self.task_ids[step * TASKS_PER_STEP : (step + 1) * TASKS_PER_STEP]
                if step == steps - 1:
                    tasks = self.task_ids[step * TASKS_PER_STEP :]
                for message_id in tasks:
                    self._until_acknowledged(lambda m=message_id: self._receive(m))
                    self.fed += 1
                replies = self.reply_ids[step * share : (step + 1) * share]
                if replies:
                    self._until_acknowledged(lambda r=replies: self._publish(r))
                    self.fed += len(replies)
        except BaseException as exc:
            self.error = exc
        finally:
            self._queue.close()

    def finish(self, timeout: float = 120.0) -> None:
        """Wait for the feeder, re-raise its error, and count everything it sent as ACKed."""
        self.join(timeout)
        assert not self.is_alive(), "the feeder did not finish"
        if self.error is not None:
            raise AssertionError(f"the feeder failed: {self.error!r}") from self.error
        self.system.acknowledge(self.task_ids)
        self.system.published += self.reply_ids

    def _receive(self, message_id: str) -> None:
        self._queue.receive(AuthContext(SENDER), envelope(message_id, self.system.deadline))

    def _publish(self, reply_ids: list[str]) -> None:
        with Session(self._queue.engine) as session, session.begin():
            for reply_id in reply_ids:
                outbox.publish(session, "default", reply_id, {"id": reply_id})

    def _until_acknowledged(self, send: Callable[[], None]) -> None:
        """Send until it commits: after a database error the outcome is unknown, so send again."""
        deadline = time.monotonic() + RESEND_FOR
        while True:
            try:
                send()
                return
            except sa.exc.DBAPIError:
                if time.monotonic() > deadline:
                    raise
                self.resends += 1
                time.sleep(RESEND_PAUSE)  # the database is away: pace the resends


def start_all(system: System) -> list[Node]:
    """A receiver, WORKERS workers and RELAYS relays, running."""
    nodes = [system.start("receiver")]
    nodes += [system.start("worker") for _ in range(WORKERS)]
    nodes += [system.start("relay") for _ in range(RELAYS)]
    return nodes


def when_fed(feeder: Feeder, share: float) -> None:
    """Wait until the feeder has sent `share` of its work (it must still be running)."""
    wait_until(
        lambda: feeder.fed >= share * feeder.total or not feeder.is_alive(),
        60,
        f"the feeder to send {share:.0%} of its work",
    )
    assert feeder.is_alive(), f"the feeder ended before the fault ({feeder.error!r})"


def sessions_of(engine: sa.Engine, names: list[str]) -> set[str]:
    """Which of the processes named `names` hold a session on the database now."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT DISTINCT application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = ANY(:names)"
            ),
            {"names": names},
        ).scalars()
        return set(rows)


def terminate_sessions_of(engine: sa.Engine, names: list[str]) -> dict[str, int]:
    """pg_terminate_backend every session of the processes named `names`; count per name."""
    # The call sits in the select list of a materialized CTE's rows: in a WHERE clause the
    # planner may run it before the other filters, i.e. on every session of the server.
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "WITH chosen AS MATERIALIZED (SELECT pid, application_name "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = ANY(:names) AND pid <> pg_backend_pid()) "
                "SELECT application_name, pg_terminate_backend(pid) FROM chosen"
            ),
            {"names": names},
        ).all()
    return dict(Counter(name for name, terminated in rows if terminated))


def settle(system: System, last_fault: float) -> Tally:
    """Drain until settled, at most SETTLE_WITHIN seconds after `last_fault` (monotonic)."""
    return system.drain(timeout=max(0.0, last_fault + SETTLE_WITHIN - time.monotonic()))


def check_outcome(system: System, found: Tally, nodes: list[Node], messages: int) -> None:
    """Every reply there, every task done, every dead reply with its reason, nobody exited
    (the invariants are asserted by record_then_assert, before this)."""
    assert found.messages == messages, f"expected {messages} replies, found {found.messages}"
    engine = outbox.create_engine(system.db_url)
    try:
        with engine.connect() as conn:
            silent_dead = conn.execute(
                sa.text(
                    "SELECT reply_id FROM outbox_messages WHERE state = 'dead' "
                    "AND (last_error IS NULL OR last_error = '')"
                )
            ).scalars()
            assert not list(silent_dead), "dead replies without a recorded reason"
            states = dict(
                conn.execute(
                    sa.text("SELECT state, count(*) FROM outbox_tasks GROUP BY state")
                ).all()
            )
    finally:
        engine.dispose()
    # The handler never fails: a task could only fail by losing all its attempts to faults.
    assert set(states) == {"done"}, f"task states: {states}\n{system.logs()}"
    exited = [f"{n.name} (exit {n.exitcode})" for n in nodes if not n.alive]
    assert not exited, f"processes exited: {exited}\n{system.logs()}"


@pytest.mark.postgresql_only
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_terminated_sessions_are_replaced_and_nothing_is_lost(
    backend: str, db_url: str, tmp_path: Path
) -> None:
    """Every worker's, relay's and receiver's session killed SESSION_ROUNDS times mid-run."""
    engine = outbox.create_engine(db_url)
    kills = 0
    try:
        with System(tmp_path, db_url, worker_concurrency=WORKER_CONCURRENCY) as system:
            nodes = start_all(system)
            names = [n.name for n in nodes]
            # Workers and relays hold pooled sessions from their first turn on; the
            # receiver opens one only when a reply first reaches it.
            holders = {n.name for n in nodes if not n.name.startswith("receiver")}
            feeder = Feeder(system, SESSION_TASKS, SESSION_PUBLISHED)
            feeder.start()
            for round_ in range(1, SESSION_ROUNDS + 1):
                when_fed(feeder, round_ / (SESSION_ROUNDS + 1))
                wait_until(
                    lambda: holders <= sessions_of(engine, names),
                    10,
                    "every worker and relay to hold a session again",
                )
                killed = terminate_sessions_of(engine, names)
                assert holders <= set(killed), f"sessions terminated: {killed}"
                kills += sum(killed.values())
            last_fault = time.monotonic()
            feeder.finish()
            found = settle(system, last_fault)
            record_then_assert(
                "database",
                backend,
                "sessions terminated",
                runs=SESSION_ROUNDS,
                kills=kills,
                messages=found.messages,
                found=found,
                dead_allowed=True,
            )
            check_outcome(system, found, nodes, SESSION_TASKS + SESSION_PUBLISHED)
            # Still working, on new sessions: they reconnected rather than wound down.
            wait_until(
                lambda: holders <= sessions_of(engine, names), 10, "new sessions after the faults"
            )
    finally:
        engine.dispose()


def own_server(kind: str) -> PgCluster | MariaDBServer:
    """A new server of `kind`, not started; fails under CI, skips elsewhere, without its
    binaries."""
    if kind == "postgresql":
        bin_dir = find_bin()
        if bin_dir is not None:
            return PgCluster(bin_dir)
        reason = "no initdb/pg_ctl in /usr/lib/postgresql/*/bin (set OUTBOXDEV_TEST_PG_BIN)"
    else:
        tools = find_mariadb_bin()
        if tools is not None:
            return MariaDBServer(*tools)
        reason = "no mariadb-install-db/mariadbd (set OUTBOXDEV_TEST_MARIADB_BIN)"
    if IN_CI:
        pytest.fail(f"the server's binaries are required under CI=true: {reason}")
    pytest.skip(reason)


@pytest.fixture(params=["postgresql", "mysql"])
def owned_server(request: pytest.FixtureRequest) -> Iterator[PgCluster | MariaDBServer]:
    """A running server of this test's own, of each kind."""
    with own_server(request.param) as server:
        server.start()
        yield server


def test_crash_restarts_of_the_server_lose_nothing(
    owned_server: PgCluster | MariaDBServer, tmp_path: Path
) -> None:
    """The test's own server crash-restarted RESTARTS times while 2,000 replies flow."""
    url = owned_server.create_database("outbox")
    outbox.upgrade(url)
    receiver.upgrade(url)
    backend = sa.make_url(url).get_backend_name()
    with System(
        tmp_path,
        url,
        relay_batch=RELAY_BATCH,
        relay_mode="batch",
        worker_concurrency=WORKER_CONCURRENCY,
    ) as system:
        nodes = start_all(system)
        feeder = Feeder(system, RESTART_TASKS, RESTART_PUBLISHED)
        feeder.start()
        for restart in range(1, RESTARTS + 1):
            when_fed(feeder, restart / (RESTARTS + 1))
            last_fault = owned_server.restart()
        feeder.finish()
        # The client felt the crashes: its sends failed and were sent again.
        assert feeder.resends > 0, "no send failed: the crashes came between the sends"
        found = settle(system, last_fault)
        record_then_assert(
            "database",
            backend,
            "server crash-restarted",
            runs=RESTARTS,
            kills=RESTARTS,
            messages=found.messages,
            found=found,
            dead_allowed=True,
        )
        check_outcome(system, found, nodes, RESTART_TASKS + RESTART_PUBLISHED)


HELD_FOR = 3.0  # seconds the destination holds the first POST of the in-flight reply


@pytest.mark.postgresql_only
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_claim_retried_after_a_lost_connection_leaves_turns_in_flight_alone(
    backend: str, db_url: str
) -> None:
    """A relay whose claim loses its connection must not re-lease a turn it is still sending.

    The relay's first turn posts "held-1" and the destination holds that POST. Its
    pooled session is then terminated, so the next claim fails with an unknown
    outcome. That claim leased nothing of "held-1", which is still in flight on
    the first turn under an unexpired lease: it must be POSTed once, not again.
    """
    name = "relay-in-doubt"
    relay_url = sa.make_url(db_url).update_query_dict({"application_name": name})
    engine = outbox.create_engine(db_url)
    try:
        with ScriptedServer() as server:
            server.script("held-1", Answer(stall=HELD_FOR))
            publish_many(engine, ["held-1"])
            relay = Relay(
                relay_url,
                {"default": make_destination(server.url, secret=SECRET, timeout=HELD_FOR + 2)},
                owner=name,
                lease=HELD_FOR + 5,
                poll_interval=0.05,
            )
            try:
                with running_in_thread(relay):
                    wait_until(lambda: "held-1" in server.ids(), 10, "the first POST")
                    killed = terminate_sessions_of(engine, [name])
                    assert killed.get(name, 0) >= 1, f"no session of the relay: {killed}"
                    wait_until(
                        lambda: rows(engine)["held-1"]["state"] == "sent",
                        HELD_FOR + 10,
                        "held-1 to be recorded sent",
                    )
            finally:
                relay.close()
            posts = server.ids().count("held-1")
    finally:
        engine.dispose()
    assert posts == 1, f"held-1 was POSTed {posts} times while its first turn held the lease"
