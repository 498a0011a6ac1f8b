"""Kills inside a commit window, each one seen where it happened.

A node set to stop (SIGSTOP) at a `*.before_commit` failpoint is looked at
while it is stopped, then SIGKILLed without being resumed:

- PostgreSQL: one of the node's sessions (found by its application_name) is
  `idle in transaction` with a transaction id, and holds RowExclusiveLock on
  the tables the point's statements write: the server holds the transaction's
  uncommitted writes. After the kill, that transaction id is `aborted`
  (pg_xact_status): the writes rolled back.
- MySQL and MariaDB: one of the node's sessions (found by the local ports of the
  node's sockets, which the server's process list shows as the client's) holds an
  InnoDB transaction that has changed rows and holds write intention (IX) locks on the
  tables the point's statements write (support.innodb_window). After the kill, that
  transaction is gone from InnoDB's status: the server rolled it back when the
  client's connection closed.
- SQLite: the node holds the database's write lock (a test connection's
  BEGIN IMMEDIATE is refused at once): its transaction is open. SQLite has no
  server to ask what the transaction wrote; that it never committed is what
  the caller's invariant checker then finds.

A kill is counted only when the look found the transaction open with its writes.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sqlalchemy as sa
from support.innodb_window import client_ports, open_transactions

import outbox
from benchmarks.cpu import port_owners
from faults.nodes import Node

WRITES = {
    "intake.before_commit": {"outbox_inbox", "outbox_tasks"},
    "claim.before_commit": {"outbox_tasks"},
    "finish.before_commit": {"outbox_tasks", "outbox_messages"},
    "relay.before_sent_commit": {"outbox_messages"},
    "receiver.before_commit": {"receiver_receipts", "receiver_effects"},
}
"""Per failpoint, the tables its transaction has written when it gets there."""
POINTS = frozenset(WRITES)
STOP_WITHIN = 60.0
"""Seconds for a node to reach its failpoint (a busy machine starts processes slowly)."""
ABORT_WITHIN = 60.0
"""Seconds for the server to notice the dead client and roll its transaction back."""

# The node's open write transactions: its sessions with a transaction id, the 64-bit id
# (the server's epoch joined to the 32-bit backend_xid) and the tables it has written.
# The epoch comes from an id assigned to this statement's own transaction, which is newer
# than every backend_xid already assigned; a snapshot's xmax is not (it is the latest
# completed id plus one, so a transaction still open may hold a larger id, and the
# wraparound test below then took it for the previous epoch's).
_OPEN_WRITES = sa.text(
    """
    WITH top AS (SELECT pg_current_xact_id()::text::bigint AS xid)
    SELECT a.pid, a.state,
           (((top.xid >> 32) - CASE WHEN a.backend_xid::text::bigint > (top.xid & 4294967295)
                                    THEN 1 ELSE 0 END) << 32)
             | a.backend_xid::text::bigint AS xid,
           array(SELECT c.relname::text FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                 WHERE l.pid = a.pid AND l.mode = 'RowExclusiveLock' AND c.relkind = 'r')
             AS written
    FROM pg_stat_activity a, top
    WHERE a.datname = current_database() AND a.application_name = :name
      AND a.backend_xid IS NOT NULL
    """
)
_SESSIONS = sa.text(
    "SELECT pid, application_name, state, backend_xid, left(query, 60) FROM pg_stat_activity "
    "WHERE datname = current_database()"
)
_STATUS = sa.text("SELECT pg_xact_status(CAST(CAST(:xid AS text) AS xid8))")


@dataclass(frozen=True)
class Held:
    """What the look at a stopped node found: its open transactions' ids and tables."""

    node: str
    xids: tuple[int, ...]
    written: frozenset[str]


def kill_in_commit_window(
    nodes: Iterable[Node], point: str, db_url: str, logs: Callable[[], str]
) -> list[Held]:
    """Look at each node stopped at `point`, SIGKILL it, see its writes roll back.

    Nodes may stop in any order (on SQLite, one at a time: the others wait for
    the write lock the stopped one holds). Fails when a node exits instead, or
    when the look finds no open transaction holding the point's writes.
    """
    if point not in POINTS:
        raise ValueError(f"{point!r} is not a before-commit failpoint")
    waiting = list(nodes)
    seen: list[Held] = []
    engine = outbox.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        deadline = time.monotonic() + STOP_WITHIN * max(1, len(waiting))
        while waiting:
            stopped = [node for node in waiting if node.paused]
            for node in stopped:
                seen.append(_look_and_kill(engine, node, point))
                waiting.remove(node)
            for node in waiting:
                assert node.alive, f"{node.name} exited ({node.exitcode}) before {point}\n{logs()}"
            assert time.monotonic() < deadline, f"no stop at {point} in time\n{logs()}"
            if waiting and not stopped:
                time.sleep(0.05)
    finally:
        engine.dispose()
    return seen


def _look_and_kill(engine: sa.Engine, node: Node, point: str) -> Held:
    if engine.dialect.name == "sqlite":
        database = engine.url.database
        assert database is not None
        assert _write_locked(database), f"{node.name} stopped at {point} without the write lock"
        # The lock dies with the process; a node waiting for it may take it at once.
        _kill(node)
        return Held(node.name, (), frozenset())
    if engine.dialect.name in ("mysql", "mariadb"):
        return _look_and_kill_innodb(engine, node, point)
    with engine.connect() as conn:
        rows = conn.execute(_OPEN_WRITES, {"name": node.name}).all()
    holding = [
        r for r in rows if r.state == "idle in transaction" and WRITES[point] <= set(r.written)
    ]
    if not holding:
        with engine.connect() as conn:
            sessions = conn.execute(_SESSIONS).all()
        raise AssertionError(
            f"{node.name} stopped at {point}, but the server holds no transaction of it with "
            f"writes to {sorted(WRITES[point])}: {rows}; the sessions: {sessions}\n{node.tail()}"
        )
    _kill(node)
    # Only the transactions seen holding the step's writes: another of its sessions may
    # have committed on its own between the look and the kill.
    xids = tuple(int(r.xid) for r in holding)

    def aborted() -> bool:
        with engine.connect() as conn:
            return all(conn.execute(_STATUS, {"xid": x}).scalar() == "aborted" for x in xids)

    _wait(aborted, f"{node.name}'s transactions {xids} to roll back")
    return Held(node.name, xids, frozenset().union(*(set(r.written) for r in holding)))


def _look_and_kill_innodb(engine: sa.Engine, node: Node, point: str) -> Held:
    ports = {port for port, pid in port_owners({node.pid}).items() if pid == node.pid}
    sessions = {s for s, port in client_ports(engine).items() if port in ports}
    found = open_transactions(engine)
    holding = [
        t
        for t in found
        if t.thread_id in sessions and t.rows_changed > 0 and WRITES[point] <= t.written
    ]
    assert holding, (
        f"{node.name} stopped at {point}, but the server holds no transaction of it with "
        f"writes to {sorted(WRITES[point])}: its sessions {sorted(sessions)} (ports "
        f"{sorted(ports)}); every open transaction: {found}\n{node.tail()}"
    )
    _kill(node)
    trx_ids = {t.trx_id for t in holding}

    def rolled_back() -> bool:
        return not trx_ids & {t.trx_id for t in open_transactions(engine)}

    _wait(rolled_back, f"{node.name}'s transactions {sorted(trx_ids)} to roll back")
    return Held(node.name, (), frozenset().union(*(t.written for t in holding)))


def _kill(node: Node) -> None:
    """SIGKILL a stopped node as it is: no SIGCONT first, which would let it commit."""
    node.retired = True
    os.kill(node.pid, signal.SIGKILL)
    node.wait(30)
    assert node.exitcode == -signal.SIGKILL, f"{node.name} exited with {node.exitcode}"


def _write_locked(database: str) -> bool:
    """Whether another connection holds the SQLite database's write lock now."""
    probe = sqlite3.connect(database, timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return True
        raise
    else:
        probe.execute("ROLLBACK")
        return False
    finally:
        probe.close()


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + ABORT_WITHIN
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
