"""What InnoDB's own status says of the open transactions: each one's id, its session,
the rows it changed and the tables it holds write intentions on.

Read from SHOW ENGINE INNODB STATUS rather than information_schema.INNODB_TRX: InnoDB
serves INNODB_TRX from a cache it refreshes only once the table has gone unread for
0.1 s, so tests polling it side by side on one server saw a transaction for as long as
they polled, a minute after it had rolled back. The status is built anew at each read;
its transactions list their table locks once innodb_status_output_locks is on (at most
ten locks each: a table whose lock is cut off fails the caller's look, never passes it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sqlalchemy as sa

_TRANSACTION = re.compile(r"^---TRANSACTION (\d+), (.*?)(?=^---TRANSACTION |^-{4,}$)", re.M | re.S)
_THREAD = re.compile(r"(?:MariaDB|MySQL) thread id (\d+)")
_UNDO = re.compile(r"undo log entries (\d+)")
_WRITE_INTENT = re.compile(r"TABLE LOCK table `([^`]*)`\.`([^`]+)` trx id \d+ lock mode IX")


@dataclass(frozen=True)
class Transaction:
    """One open InnoDB transaction, as the engine's status shows it."""

    trx_id: str
    thread_id: int | None
    rows_changed: int
    written: frozenset[str]
    """The tables it holds write intentions on (IX locks), by name."""
    databases: frozenset[str]
    """The databases those tables are in."""


def parse_status(status: str) -> list[Transaction]:
    """The started transactions of an InnoDB status text (not-started ones have no id)."""
    found: list[Transaction] = []
    for match in _TRANSACTION.finditer(status):
        trx_id, body = match.groups()
        thread = _THREAD.search(body)
        undo = _UNDO.search(body)
        intents = _WRITE_INTENT.findall(body)
        found.append(
            Transaction(
                trx_id,
                int(thread.group(1)) if thread else None,
                int(undo.group(1)) if undo else 0,
                frozenset(table for _, table in intents),
                frozenset(database for database, _ in intents),
            )
        )
    return found


def open_transactions(engine: sa.Engine) -> list[Transaction]:
    """The server's open InnoDB transactions now, with their table locks."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET GLOBAL innodb_status_output_locks = ON")
        row = conn.exec_driver_sql("SHOW ENGINE INNODB STATUS").one()
    return parse_status(str(row[-1]))


def client_ports(engine: sa.Engine) -> dict[int, int]:
    """Each session of the server by id: its client's port (TCP sessions only)."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT ID, HOST FROM information_schema.PROCESSLIST").all()
    ports: dict[int, int] = {}
    for session, host in rows:
        _, colon, port = str(host).rpartition(":")
        if colon and port.isdigit():
            ports[int(session)] = int(port)
    return ports
