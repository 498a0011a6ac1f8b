"""A deployment of real processes on one database: workers, relays, a receiver.

Every process reads one TOML file, as an operator's would. Work enters through
the intake (in the test process, or in an intake child that may crash) and
through publish(); `drain()` waits for the run to settle and counts the
invariants (see faults.invariants).
"""

from __future__ import annotations

import base64
import itertools
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.receiver_helpers import free_port, wait_until

import outbox
from faults import invariants
from faults.nodes import Node
from faults.work import SENDER, envelope
from outbox import AuthContext, TaskQueue

ROLES = ("worker", "relay", "receiver")
HOT_KEY = "hot"
COLD_KEYS = 8


def ordering_key(n: int) -> str:
    """The ordering key of the `n`-th published reply: every other one has HOT_KEY, which so
    carries half the published traffic; the others take COLD_KEYS keys in turn."""
    return HOT_KEY if n % 2 == 0 else f"cold-{(n // 2) % COLD_KEYS}"


class System:
    """Processes sharing one database and one config file; closes them all on exit."""

    def __init__(
        self,
        folder: Path,
        db_url: str,
        *,
        lease: float = 1.0,
        relay_batch: int = 1,
        relay_mode: str = "single",
        ordered_batches: bool = False,
        attempts: int = 50,
        worker_concurrency: int = 1,
    ) -> None:
        """Write the config; nothing runs until `start()`."""
        self.folder = folder
        self.db_url = db_url
        self.port = free_port()
        self.deadline = time.time() + 24 * 3600
        self.acknowledged: list[tuple[str, str]] = []
        self.published: list[str] = []
        self.nodes: list[Node] = []
        self._ids = itertools.count(1)
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        secret_file = folder / "secret"
        secret_file.write_text(secret + "\n", encoding="utf-8")
        self.config = folder / "outbox.toml"
        self.config.write_text(
            "\n".join(
                [
                    f'db = "{db_url}"',
                    "[worker]",
                    'handler = "faults.work:compute"',
                    f"lease = {lease}",
                    f"concurrency = {worker_concurrency}",
                    "poll_interval = 0.2",
                    "[relay]",
                    # An attempt (timeout 1 s) must fit in the relay's lease.
                    f"lease = {max(lease, 2.0)}",
                    "poll_interval = 0.1",
                    "backoff = 0.05",
                    "backoff_cap = 0.3",
                    f"max_attempts = {attempts}",
                    f"batch = {relay_batch}",
                    "[destinations.default]",
                    f'url = "http://127.0.0.1:{self.port}/replies"',
                    f'secret_file = "{secret_file}"',
                    "timeout = 1",
                    f'mode = "{relay_mode}"',
                    f"ordered_batches = {'true' if ordered_batches else 'false'}",
                    "[receiver]",
                    f"port = {self.port}",
                    f'secret_file = "{secret_file}"',
                    "",
                ]
            ),
            encoding="utf-8",
        )
        self._queue = TaskQueue(db_url, allowed_sources=(SENDER,))

    def __enter__(self) -> System:
        """The system; every process is stopped on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop every process still running, then close the test's own queue."""
        self.close()

    def start(
        self,
        role: str,
        failpoint: str | None = None,
        name: str | None = None,
        action: str = "exit",
    ) -> Node:
        """Start a worker, relay or receiver process (a receiver is started once healthy)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        name = name or f"{role}-{len(self.nodes) + 1}"
        argv: list[str] = [role, "--config", str(self.config)]
        if role != "receiver":
            argv += ["--owner", name]
        node = self._launch(name, "faults.work:cli", [argv], failpoint, action)
        if role == "receiver":
            wait_until(lambda: self._healthy(node), 30, f"{name} to answer /healthz")
        return node

    def submit(
        self, message_ids: list[str], failpoint: str | None = None, action: str = "exit"
    ) -> Node:
        """An intake child that sends each envelope until it is acknowledged."""
        return self._launch(
            f"intake-{len(self.nodes) + 1}",
            "faults.work:submit",
            [self.db_url, message_ids, self.deadline],
            failpoint,
            action,
        )

    def acknowledge(self, message_ids: list[str]) -> None:
        """Count `message_ids` as ACKed: a client that saw the intake crash sent them again."""
        self.acknowledged += [(SENDER, m) for m in message_ids]

    def intake(self, count: int) -> list[str]:
        """Receive `count` new tasks in the test process; each is ACKed."""
        ids = self.new_ids("m", count)
        for message_id in ids:
            self._queue.receive(AuthContext(SENDER), envelope(message_id, self.deadline))
        self.acknowledge(ids)
        return ids

    def publish(self, count: int) -> list[str]:
        """Publish `count` new replies, each in its own transaction, with ordering keys (half
        of them the hot key: see ordering_key)."""
        ids = self.new_ids("pub", count)
        for reply_id in ids:
            key = ordering_key(len(self.published))
            with Session(self._queue.engine) as session, session.begin():
                outbox.publish(session, "default", reply_id, {"id": reply_id}, ordering_key=key)
            self.published.append(reply_id)
        return ids

    def new_ids(self, prefix: str, count: int) -> list[str]:
        """`count` identifiers never used in this system."""
        return [f"{prefix}-{next(self._ids)}" for _ in range(count)]

    def drain(self, timeout: float = 60.0) -> invariants.Tally:
        """Wait until nothing is left to do (or `timeout`), then count the invariants."""
        return invariants.drain(
            self.db_url,
            timeout=timeout,
            acknowledged=self.acknowledged,
            published=self.published,
            watch=self.check_running,
        )

    def check_running(self) -> None:
        """Fail at once when a process started without a failpoint has exited unasked."""
        for node in self.nodes:
            if node.failpoint is None and not node.retired and node.exitcode not in (None, 0):
                raise AssertionError(f"{node.name} exited with {node.exitcode}\n{self.logs()}")

    def leases(self, table: str) -> dict[str, tuple[str, str | None, int]]:
        """(state, owner, fence) of every task (table "tasks") or reply ("messages")."""
        key = {"tasks": "task_id", "messages": "reply_id"}[table]
        with self._queue.engine.connect() as conn:
            rows = conn.execute(
                sa.text(f"SELECT {key}, state, owner, fence FROM outbox_{table}")
            ).all()
        return {r[0]: (r[1], r[2], int(r[3])) for r in rows}

    def sent_fraction(self) -> float:
        """The share of this run's replies already sent (0.0 when there are none yet)."""
        with self._queue.engine.connect() as conn:
            sent, total = conn.execute(
                sa.text(
                    "SELECT sum(CASE WHEN state = 'sent' THEN 1 ELSE 0 END), count(*) "
                    "FROM outbox_messages"
                )
            ).one()
        return float(sent) / total if total else 0.0

    def logs(self) -> str:
        """The tail of every process's output, for failure messages."""
        return "\n".join(f"--- {n.name} (exit {n.exitcode})\n{n.tail()}" for n in self.nodes)

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL) and close the queue."""
        for node in self.nodes:
            node.stop()
        self._queue.close()

    def _launch(
        self,
        name: str,
        target: str,
        args: list[Any],
        failpoint: str | None,
        action: str = "exit",
    ) -> Node:
        node = Node(name, target, args, self.folder / f"{name}.log", failpoint, action)
        self.nodes.append(node)
        return node

    def _healthy(self, node: Node) -> bool:
        if node.failpoint is not None and (
            node.paused or (node.wait(0) is not None and node.died_at_failpoint())
        ):
            return True  # work was waiting, so it reached its failpoint before our first look
        if not node.alive:
            raise AssertionError(f"{node.name} exited with {node.exitcode}:\n{node.tail()}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False
