"""Model-based test: a Hypothesis state machine over the task queue, the outbox and delivery.

Every step runs against the real product (TaskQueue, publish(), a Relay posting to the
reference receiver over HTTP) and against a small in-memory model of docs/explanation/contract.md
(tasks, delivery, receiving, failure windows).
After every step the database must equal the model (tasks, inbox, outbox rows, receipts
and effects), so nothing of a rolled-back transaction can stay visible, and the
invariants must hold: one live lease per task, fences that never go down, attempts
within their budget, exactly one reply per terminal task, one effect per receipt. At
teardown everything is drained and `faults.invariants.tally` must find the run clean.

Crashes are in-process failpoints (`outbox.failpoints.arm`): "before_commit" means
nothing happened; "after_commit" means committed but the caller never heard. A lost ACK
is `relay.after_remote_commit` around `dispatch_once()`: the receiver committed, the
relay recorded nothing, and only after the lease expired may the row be sent again; the
receiver must then answer "duplicate" (or the receipt lookup settles it once the
delivery budget is spent).

Set-up, chosen so that examples are cheap and replay exactly from their blob:
- one migrated database per test (`db_url`), shared by every example: each example
  empties every table (DELETE, ids restarted) instead of copying a
  file or creating a database;
- one reference receiver per test: `create_app(ReceiptStore(db_url), ...)` with the
  reference effect, the code that `outbox receiver` serves, run by uvicorn on a thread
  from a socket that is bound and listening before the thread starts (so nothing waits
  for it to come up). It works on the same database, so it sees each example's reset.
  A thin ASGI wrapper logs its answers (stored / duplicate per reply_id), which a child
  process would hide;
- one TaskQueue and one relay per mode (single, batch) per test, on shared engines:
  opening one checks the schema, which costs more than a whole step. Each example
  starts with the one ManualClock moved far ahead (nothing a relay scheduled by the
  clock reaches into it) and the RNGs reseeded, so it depends on nothing that ran
  before it. A relay that dies while recording its outcomes would keep that turn in
  memory to record it later, which a dead process cannot: it is replaced by a new one
  with the same owner name, as a restarted sidecar would be. Dying earlier, a relay
  holds nothing in memory but when it next reaps expired leases, and whether a turn
  reaped them is read back, so carrying on with it is as good as a restart;
- the snapshot read after every step goes through a plain DBAPI connection in
  autocommit: through SQLAlchemy it cost more than the step it checks.

Nothing sleeps: time moves only through `ManualClock.advance`. Failing examples print
their steps and a `@reproduce_failure` blob (add it to `ModelMachine`); no example
database is written into the checkout.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields
from functools import wraps
from typing import Any, ClassVar, TypeVar, cast

import pytest
import sqlalchemy as sa
import uvicorn
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from support.environment import empty_tables
from support.receiver_helpers import SECRET

import outbox
from faults.figures import record_then_assert
from faults.invariants import Tally, tally
from outbox import AuthContext, Claim, Envelope, Fenced, PayloadCollision, TaskQueue
from outbox.failpoints import Crash, arm
from outbox.testing import ManualClock
from receiver import ReceiptStore, create_app
from receiver.effects import record_effect
from relay import Destination, Relay, make_destination

START = 1_000_000.0
# Each example starts this long after the last one ended: nothing a reused relay
# scheduled by the clock (its next reap of expired leases) reaches into the new example.
EXAMPLE_GAP = 100_000.0
SOURCES = ("agent-a", "agent-b")
MESSAGE_IDS = ("m0", "m1", "m2", "m3")
OWNERS = ("w1", "w2")
PUBLISH_IDS = ("pub-0", "pub-1", "pub-2")
ORDERING_KEYS = (None, "k")
TASK_LEASE = 10.0
BACKOFF = 2.0
BACKOFF_CAP = 300.0
MAX_HOPS = 4
# The `error.code` a reply may carry for each terminal state other than done.
END_CODES = {
    "failed": {"permanent_failure", "attempts_exhausted", "lease_expired"},
    "cancelled": {"cancelled"},
    "expired": {"deadline_passed"},
    "hop_limit": {"hop_limit"},
}
RELAY_LEASE = 30.0
# Two attempts: a message reclaimed twice without an answer reaches the "resolve" path.
RELAY_ATTEMPTS = 2
RELAY_BATCH = 100
RELAY_OWNERS = {"single": "relay-single", "batch": "relay-batch"}
MODES = tuple(RELAY_OWNERS)
TERMINAL = frozenset({"done", "failed", "cancelled", "expired", "hop_limit"})
LIVE = frozenset({"pending", "running"})
UNDELIVERED = frozenset({"pending", "sending"})

# (examples, steps) per backend; --soak multiplies the examples.
PROFILES = {"sqlite": (200, 50), "postgresql": (50, 30), "mysql": (50, 30)}
SOAK_FACTOR = 10

F = TypeVar("F", bound=Callable[..., Any])


# --- the model's own idea of identities and bodies (docs/explanation/contract.md, identity) ---


def canonical(value: object) -> bytes:
    """Canonical JSON: sorted keys, no spaces, UTF-8 unescaped."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def sha256(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def task_id_for(principal: str, message_id: str) -> str:
    """The task identity: sha256 of canonical [principal, message_id]."""
    return sha256(canonical([principal, message_id]))


def armed(point: str | None) -> AbstractContextManager[None]:
    """Arm `point` for the block, or nothing when None."""
    return nullcontext() if point is None else arm(point)


class CallerFailed(Exception):
    """The caller's own transaction fails after publish(), so all of it rolls back."""


# --- the model -----------------------------------------------------------------


@dataclass
class TaskModel:
    """What one outbox_tasks row must hold."""

    task_id: str
    payload: dict[str, Any]
    deadline: float
    max_attempts: int
    priority: int
    created_at: float
    state: str
    available_at: float
    attempts: int = 0
    fence: int = 0
    owner: str | None = None
    lease_until: float | None = None
    result: Any = None

    def view(self) -> dict[str, Any]:
        """The columns compared with the database (owner only while it means something)."""
        return {
            "state": self.state,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "fence": self.fence,
            "owner": self.owner if self.state == "running" else None,
            "lease_until": self.lease_until,
            "available_at": self.available_at,
            "deadline": self.deadline,
            "result": self.result,
        }


@dataclass
class MessageModel:
    """What one outbox_messages row must hold, and whether the receiver holds it."""

    reply_id: str
    task_id: str | None
    body: bytes
    ordering_key: str | None
    available_at: float
    seq: int
    state: str = "pending"
    attempts: int = 0
    fence: int = 0
    owner: str | None = None
    lease_until: float | None = None
    received: bool = False

    def view(self) -> dict[str, Any]:
        """The columns compared with the database."""
        return {
            "task_id": self.task_id,
            "state": self.state,
            "attempts": self.attempts,
            "fence": self.fence,
            "owner": self.owner if self.state == "sending" else None,
            "lease_until": self.lease_until,
            "available_at": self.available_at,
            "body": self.body,
            "content_hash": sha256(self.body),
            "ordering_key": self.ordering_key,
        }


@dataclass
class Snapshot:
    """The database as the invariants read it, once per step."""

    tasks: dict[str, dict[str, Any]]
    messages: dict[str, dict[str, Any]]
    inbox: dict[tuple[str, str], str]
    receipts: dict[str, str]
    effects: dict[str, int]


TASK_COLUMNS = (
    "state",
    "attempts",
    "max_attempts",
    "fence",
    "owner",
    "lease_until",
    "available_at",
    "deadline",
    "result",
)
MESSAGE_COLUMNS = (
    "task_id",
    "state",
    "attempts",
    "fence",
    "owner",
    "lease_until",
    "available_at",
    "body",
    "content_hash",
    "ordering_key",
)
SNAPSHOT_QUERIES = (
    f"SELECT task_id, {', '.join(TASK_COLUMNS)} FROM outbox_tasks",
    f"SELECT reply_id, {', '.join(MESSAGE_COLUMNS)} FROM outbox_messages",
    "SELECT principal, message_id, task_id FROM outbox_inbox",
    "SELECT reply_id, content_hash FROM receiver_receipts",
    "SELECT reply_id, count(*) FROM receiver_effects GROUP BY reply_id",
)


def read_snapshot(reader: Any) -> Snapshot:
    """Read every row the model describes, on an autocommit DBAPI connection."""
    cursor = reader.cursor()
    try:
        results = []
        for query in SNAPSHOT_QUERIES:
            cursor.execute(query)
            results.append(cursor.fetchall())
    finally:
        cursor.close()
    task_rows, message_rows, inbox_rows, receipt_rows, effect_rows = results
    tasks: dict[str, dict[str, Any]] = {}
    for task_id, *values in task_rows:
        task = tasks[task_id] = dict(zip(TASK_COLUMNS, values, strict=True))
        task["owner"] = task["owner"] if task["state"] == "running" else None
        task["result"] = None if task["result"] is None else json.loads(task["result"])
    messages: dict[str, dict[str, Any]] = {}
    for reply_id, *values in message_rows:
        message = messages[reply_id] = dict(zip(MESSAGE_COLUMNS, values, strict=True))
        message["owner"] = message["owner"] if message["state"] == "sending" else None
        message["body"] = bytes(message["body"])
    inbox = {(principal, message_id): task_id for principal, message_id, task_id in inbox_rows}
    receipts = dict(receipt_rows)
    effects = {reply_id: int(count) for reply_id, count in effect_rows}
    return Snapshot(tasks, messages, inbox, receipts, effects)


def differences(kind: str, actual: dict[Any, Any], expected: dict[Any, Any]) -> list[str]:
    """Human-readable differences between the database (`actual`) and the model."""
    found: list[str] = []
    for key in sorted(set(actual) | set(expected), key=repr):
        if key not in expected:
            found.append(f"{kind} {key!r} is in the database only: {actual[key]}")
        elif key not in actual:
            found.append(f"{kind} {key!r} is missing from the database: {expected[key]}")
        elif actual[key] != expected[key]:
            if isinstance(expected[key], dict):
                cols = {
                    c: (actual[key].get(c), expected[key][c])
                    for c in expected[key]
                    if actual[key].get(c) != expected[key][c]
                }
                found.append(f"{kind} {key!r} differs (database, model): {cols}")
            else:
                found.append(f"{kind} {key!r}: database {actual[key]!r}, model {expected[key]!r}")
    return found


# --- the reference receiver, in-process and observed -----------------------------------


class AnswerLog:
    """ASGI wrapper around the receiver app: keeps each answer as (kind, reply_id, answer)."""

    def __init__(self, app: ASGIApp) -> None:
        """Wrap `app`."""
        self.app = app
        self._lock = threading.Lock()
        self._answers: list[tuple[str, str, str]] = []

    def take(self) -> list[tuple[str, str, str]]:
        """The answers since the last call."""
        with self._lock:
            taken, self._answers = self._answers, []
        return taken

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request through, noting the answer before its last byte is sent."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def keep(message: Message) -> None:
            """Collect the answer; log it before the client can have read all of it."""
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    self._note(scope["method"], scope["path"], status, bytes(body))
            await send(message)

        await self.app(scope, receive, keep)

    def _note(self, method: str, path: str, status: int, body: bytes) -> None:
        """Log one answer: POSTs per reply as stored / duplicate / status, GETs as lookups."""
        rows: list[tuple[str, str, str]] = []
        if method == "GET" and path.startswith("/replies/"):
            rows.append(("lookup", path.removeprefix("/replies/"), str(status)))
        elif method == "POST" and status != 200:
            rows.append(("post", "?", str(status)))
        elif method == "POST" and path == "/replies":
            doc = json.loads(body)
            rows.append(("post", doc["reply_id"], "duplicate" if doc["duplicate"] else "stored"))
        elif method == "POST" and path == "/replies/batch":
            rows.extend(("post", r["reply_id"], r["status"]) for r in json.loads(body)["results"])
        with self._lock:
            self._answers.extend(rows)


class ReceiverThread:
    """uvicorn serving an app on a thread, from a socket already listening when it starts."""

    def __init__(self, app: ASGIApp) -> None:
        """Bind and listen at once: connections queue until uvicorn accepts them."""
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.base = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        # Keep-alive outlasts the test: a server closing an idle connection while the
        # relay reuses it would turn into a retry the model does not expect.
        config = uvicorn.Config(app, log_level="error", lifespan="off", timeout_keep_alive=3600)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> ReceiverThread:
        """Start serving."""
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop serving and release the socket."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


# --- per-test harness ------------------------------------------------------------


@dataclass
class Harness:
    """What every example of one test shares, and the figures summed over its examples.

    The queue and the relays live for the whole test: opening one checks the schema,
    which costs more than a whole step. Between examples the tables are emptied, the
    clock jumps ahead and the RNGs are reseeded, so no example sees another's traces.
    """

    backend: str
    url: str
    engine: sa.Engine
    relay_engine: sa.Engine
    reader: Any
    log: AnswerLog
    base: str
    clock: ManualClock = field(default_factory=lambda: ManualClock(START))
    rng: random.Random = field(default_factory=random.Random)
    queue: TaskQueue | None = None
    relays: dict[str, Relay] = field(default_factory=dict)
    runs: int = 0
    kills: int = 0
    delivered: int = 0
    duplicates: int = 0
    found: Tally = field(default_factory=Tally)

    def reset(self) -> TaskQueue:
        """Empty every table, move the clock on, reseed: returns the queue for the example."""
        with self.engine.begin() as conn:
            empty_tables(conn, self.backend)
        self.log.take()
        self.clock.advance(EXAMPLE_GAP)
        self.rng.seed(0)
        if self.queue is None:
            self.queue = TaskQueue(
                self.engine,
                clock=self.clock,
                allowed_sources=SOURCES,
                lease=TASK_LEASE,
                backoff=BACKOFF,
                backoff_cap=BACKOFF_CAP,
                max_hops=MAX_HOPS,
                rng=self.rng,
            )
        return self.queue

    def relay(self, mode: str) -> Relay:
        """The relay of `mode`, started when first needed."""
        relay = self.relays.get(mode)
        if relay is None:
            relay = self.relays[mode] = Relay(
                self.relay_engine,
                {"default": self.destination(mode)},
                owner=RELAY_OWNERS[mode],
                clock=self.clock,
                lease=RELAY_LEASE,
                backoff=BACKOFF,
                max_attempts=RELAY_ATTEMPTS,
                batch=RELAY_BATCH,
                rng=self.rng,
            )
        return relay

    def restart(self, mode: str) -> None:
        """The relay of `mode` died: the next turn is a new process with the same owner."""
        self.relays.pop(mode).close()

    def close(self) -> None:
        """Close the queue and the relays."""
        for relay in self.relays.values():
            relay.close()
        if self.queue is not None:
            self.queue.close()

    def destination(self, mode: str) -> Destination:
        """The receiver as the relay's "default" destination, with its receipt lookup."""
        return make_destination(
            self.base + "/replies",
            secret=SECRET,
            # Generous: on a loaded machine a slow answer must not turn into a retry.
            timeout=10,
            mode=mode,  # type: ignore[arg-type]
            receipt_lookup=True,
        )

    def add(self, found: Tally, kills: int, duplicates: int) -> None:
        """Sum one example's figures."""
        self.runs += 1
        self.kills += kills
        self.delivered += found.receipts
        self.duplicates += duplicates
        for f in fields(Tally):
            if f.name == "problems":
                self.found.problems.extend(found.problems[: 20 - len(self.found.problems)])
            else:
                setattr(self.found, f.name, getattr(self.found, f.name) + getattr(found, f.name))


def step(method: F) -> F:
    """A rule: invalidates the cached snapshot; a failure marks the example broken."""

    @wraps(method)
    def run(self: ModelMachine, *args: Any, **kwargs: Any) -> Any:
        """Run the rule."""
        self.version += 1
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return cast(F, run)


def checked(method: F) -> F:
    """An invariant: a failure marks the example broken, so teardown only cleans up."""

    @wraps(method)
    def run(self: ModelMachine, *args: Any, **kwargs: Any) -> Any:
        """Run the invariant."""
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return cast(F, run)


@dataclass(frozen=True)
class Intake:
    """One receive() call: a new envelope, or (`repeat`) the stored one resent."""

    source: str
    message_id: str
    variant: int
    deadline_in: float
    max_attempts: int
    hops: int
    priority: int
    repeat: bool


INTAKES = st.builds(
    Intake,
    source=st.sampled_from(SOURCES),
    message_id=st.sampled_from(MESSAGE_IDS),
    variant=st.integers(0, 1),
    # 0: the deadline is already past at intake (expired at once).
    deadline_in=st.sampled_from([3600.0, 30.0, 8.0, 120.0, 0.0]),
    max_attempts=st.integers(1, 3),
    hops=st.sampled_from([0, 1, MAX_HOPS]),
    priority=st.integers(0, 1),
    repeat=st.booleans(),
)


class ModelMachine(RuleBasedStateMachine):
    """The product against the model, one step at a time."""

    harness: ClassVar[Harness]
    claims = Bundle("claims")

    def __init__(self) -> None:
        """A new example: empty tables, the clock moved on, reseeded RNGs."""
        super().__init__()
        self.broken = False
        self.version = 0
        self._cached: tuple[int, Snapshot] | None = None
        self.queue = self.harness.reset()
        self.clock = self.harness.clock
        self.tasks: dict[str, TaskModel] = {}
        self.envelopes: dict[tuple[str, str], Envelope] = {}
        self.inbox: dict[tuple[str, str], str] = {}
        self.messages: dict[str, MessageModel] = {}
        self.seq = 0
        # task_id -> (owner, fence) of the newest lease taken, handed out or not.
        self.newest: dict[str, tuple[str, int]] = {}
        self.handed: dict[str, list[Claim]] = {}
        self.seen_task_fences: dict[str, int] = {}
        self.seen_message_fences: dict[str, int] = {}
        self.acknowledged: set[tuple[str, str]] = set()
        self.published: set[str] = set()
        self.kills = 0
        self.duplicates = 0

    # --- plumbing ---------------------------------------------------------------

    def _snapshot(self, fresh: bool = False) -> Snapshot:
        """The database after the last step, read once for all invariants."""
        if fresh or self._cached is None or self._cached[0] != self.version:
            self._cached = (self.version, read_snapshot(self.harness.reader))
        return self._cached[1]

    # --- model transitions --------------------------------------------------------

    def _add_reply(self, task: TaskModel, status: str, error: tuple[str, str] | None) -> None:
        """The task's one terminal reply, written with its terminal state."""
        reply = {"kind": "result", "task_id": task.task_id, "status": status, "result": task.result}
        if error is not None:
            reply["error"] = {"code": error[0], "reason": error[1]}
        body = canonical(reply)
        reply_id = "reply:" + task.task_id
        assert reply_id not in self.messages, f"model: second reply for task {task.task_id}"
        self.seq += 1
        self.messages[reply_id] = MessageModel(
            reply_id, task.task_id, body, None, available_at=self.clock(), seq=self.seq
        )

    def _terminate(self, task: TaskModel, state: str, error: tuple[str, str] | None = None) -> None:
        """Move a task to a terminal state with its reply; `error` is (code, reason)."""
        assert (state == "done") == (error is None), (state, error)
        task.state = state
        task.lease_until = None
        self._add_reply(task, state, error)

    def _store(self, key: tuple[str, str], envelope: Envelope) -> None:
        """Intake committed a new envelope."""
        now = self.clock()
        task_id = task_id_for(*key)
        self.envelopes[key] = envelope
        self.inbox[key] = task_id
        deadline = float(cast(float, envelope.deadline))
        task = TaskModel(
            task_id,
            payload=envelope.payload,
            deadline=deadline,
            max_attempts=envelope.max_attempts,
            priority=envelope.priority,
            created_at=now,
            state="pending",
            available_at=now,
        )
        self.tasks[task_id] = task
        if deadline <= now:
            self._terminate(task, "expired", ("deadline_passed", "deadline passed before intake"))
        elif envelope.hops >= MAX_HOPS:
            why = f"hops {envelope.hops} >= max_hops {MAX_HOPS}"
            self._terminate(task, "hop_limit", ("hop_limit", why))

    def _reconcile_tasks(self, now: float) -> tuple[int, int, int]:
        """Deadlines first, then expired leases; returns (expired, requeued, failed)."""
        expired = [t for t in self.tasks.values() if t.state in LIVE and t.deadline <= now]
        for task in expired:
            self._terminate(task, "expired", ("deadline_passed", "deadline passed"))
        reaped = [
            t
            for t in self.tasks.values()
            if t.state == "running" and t.lease_until is not None and t.lease_until <= now
        ]
        failed = 0
        for task in reaped:
            task.available_at = now
            if task.attempts >= task.max_attempts:
                failed += 1
                why = "lease expired with no attempts left"
                self._terminate(task, "failed", ("lease_expired", why))
            else:
                task.state = "pending"
                task.lease_until = None
        return len(expired), len(reaped) - failed, failed

    def _reap_messages(self, now: float) -> list[MessageModel]:
        """Deliveries whose lease expired go back to pending, due now."""
        reaped = [
            m
            for m in self.messages.values()
            if m.state == "sending" and m.lease_until is not None and m.lease_until <= now
        ]
        for message in reaped:
            message.state = "pending"
            message.available_at = now
            message.lease_until = None
        return reaped

    def _best_tasks(self, now: float) -> list[TaskModel]:
        """The claimable tasks tied for first place (priority desc, available_at, created)."""
        claimable = [
            t
            for t in self.tasks.values()
            if t.state == "pending" and t.available_at <= now and t.deadline > now
        ]
        if not claimable:
            return []
        best = min((-t.priority, t.available_at, t.created_at) for t in claimable)
        return [t for t in claimable if (-t.priority, t.available_at, t.created_at) == best]

    def _lease(self, task: TaskModel, owner: str, now: float) -> None:
        """A claim took the task."""
        task.state = "running"
        task.owner = owner
        task.lease_until = now + TASK_LEASE
        task.fence += 1
        task.attempts += 1
        self.newest[task.task_id] = (owner, task.fence)

    def _holds(self, claim: Claim, now: float) -> bool:
        """Whether the claim still holds its task: state, owner, fence, lease and deadline."""
        task = self.tasks.get(claim.task_id)
        return (
            task is not None
            and task.state == "running"
            and task.owner == claim.owner
            and task.fence == claim.fence
            and task.lease_until is not None
            and task.lease_until > now
            and task.deadline > now
        )

    def _assert_newest(self, claim: Claim) -> None:
        """Only the newest claim of a task may be accepted."""
        assert (claim.owner, claim.fence) == self.newest[claim.task_id], (
            f"accepted claim {claim.owner}/{claim.fence} is not the newest "
            f"{self.newest[claim.task_id]}"
        )

    def _deliverable(self, now: float) -> list[MessageModel]:
        """Pending, due, and first of its key, with the key's next ones chained after it
        (docs/explanation/contract.md#delivery): while each is pending, due and has
        attempts left; a head with none left starts no chain."""
        out: list[MessageModel] = []
        busy_keys: set[str] = set()
        chaining: dict[str, bool] = {}
        for message in sorted(self.messages.values(), key=lambda m: m.seq):
            key = message.ordering_key
            due = message.state == "pending" and message.available_at <= now
            if key is None:
                if due:
                    out.append(message)
                continue
            if key in chaining:
                if message.state in UNDELIVERED:
                    if chaining[key] and due and message.attempts < RELAY_ATTEMPTS:
                        out.append(message)
                    else:
                        chaining[key] = False
                continue
            if key in busy_keys or message.state not in UNDELIVERED:
                continue
            busy_keys.add(key)
            if due:
                out.append(message)
                chaining[key] = message.attempts < RELAY_ATTEMPTS
        return out

    # --- operations, each checked against the model ----------------------------------

    def _envelope(self, intake: Intake) -> Envelope:
        """The stored envelope again (`repeat`), or a new one for this identity."""
        stored = self.envelopes.get((intake.source, intake.message_id))
        if intake.repeat and stored is not None:
            return stored
        return Envelope(
            intake.message_id,
            intake.source,
            {"v": intake.variant},
            self.clock() + intake.deadline_in,
            max_attempts=intake.max_attempts,
            hops=intake.hops,
            priority=intake.priority,
        )

    def _intake(self, envelope: Envelope, crash: str | None) -> None:
        """receive(): new -> stored, same -> duplicate, other content -> PayloadCollision."""
        key = (envelope.sender, envelope.message_id)
        stored = self.envelopes.get(key)
        try:
            with armed(crash):
                ack = self.queue.receive(AuthContext(envelope.sender), envelope)
        except PayloadCollision:
            assert stored is not None, "PayloadCollision for a new message"
            assert stored != envelope, "PayloadCollision for the identical envelope"
            return
        except Crash:
            assert crash is not None
            self.kills += 1
            if crash.endswith("after_commit") and stored is None:
                self._store(key, envelope)
            return
        # A duplicate writes nothing, so it has no commit window to die in.
        assert crash is None or (crash == "intake.before_commit" and stored is not None), (
            f"receive() returned without reaching {crash}"
        )
        assert stored is None or stored == envelope, "another envelope under a stored identity"
        assert (ack.ack, ack.task_id, ack.duplicate) == (
            "stored",
            task_id_for(*key),
            stored is not None,
        ), ack
        if stored is None:
            self._store(key, envelope)
        self.acknowledged.add(key)

    def _claim(self, owner: str, crash: str | None = None) -> Claim | None:
        """claim(): reconcile, then lease the best claimable task."""
        now = self.clock()
        try:
            with armed(crash):
                got = self.queue.claim(owner)
        except Crash:
            assert crash is not None
            self.kills += 1
            if crash == "claim.after_commit":
                self._reconcile_tasks(now)
                # The caller never heard which task it took: read back which tied one it was.
                taken = [
                    t
                    for t in self._best_tasks(now)
                    if (row := self.queue.task(t.task_id)) is not None
                    and row["state"] == "running"
                    and row["fence"] == t.fence + 1
                ]
                assert len(taken) == (1 if self._best_tasks(now) else 0), taken
                for task in taken:
                    self._lease(task, owner, now)
            return None
        # A claim that leases nothing has no commit window: `got` must then be None.
        assert crash is None or (crash == "claim.before_commit" and got is None), (
            f"claim() returned without reaching {crash}"
        )
        self._reconcile_tasks(now)
        best = self._best_tasks(now)
        if got is None:
            assert not best, f"claim() found nothing; claimable: {[t.task_id for t in best]}"
            return None
        assert got.task_id in {t.task_id for t in best}, (
            f"claim() took {got.task_id}, not one of {[t.task_id for t in best]}"
        )
        task = self.tasks[got.task_id]
        self._lease(task, owner, now)
        assert (got.owner, got.fence, got.attempt, got.lease_until, got.deadline) == (
            owner,
            task.fence,
            task.attempts,
            task.lease_until,
            task.deadline,
        ), got
        assert got.payload == task.payload
        self.handed.setdefault(got.task_id, []).append(got)
        return got

    def _finish(self, claim: Claim, result: Any, crash: str | None = None) -> None:
        """finish(): done + result + reply in one commit, only for the claim that holds."""
        holds = self._holds(claim, self.clock())
        try:
            with armed(crash):
                self.queue.finish(claim, result)
        except Fenced:
            assert not holds, "finish() refused a claim that holds"
            return
        except Crash:
            assert crash is not None
            assert holds, "finish() reached its failpoint for a claim that does not hold"
            self.kills += 1
            if crash == "finish.after_commit":
                self._finished(claim, result)
            return
        assert holds, "finish() accepted a claim that does not hold"
        assert crash is None, f"finish() returned without reaching {crash}"
        self._finished(claim, result)

    def _finished(self, claim: Claim, result: Any) -> None:
        """The model side of a committed finish."""
        self._assert_newest(claim)
        task = self.tasks[claim.task_id]
        task.result = result
        self._terminate(task, "done")

    def _reconcile(self) -> None:
        """reconcile(): deadlines, expired task leases, expired delivery leases."""
        now = self.clock()
        counts = self.queue.reconcile()
        expired, requeued, failed = self._reconcile_tasks(now)
        reaped = len(self._reap_messages(now))
        assert counts == {
            "expired": expired,
            "requeued": requeued,
            "failed": failed,
            "messages_requeued": reaped,
        }, counts

    def _relay_turn(self, mode: str, crash: str | None) -> int:
        """dispatch_once() on one relay, maybe crashing at a relay failpoint; returns verdicts."""
        relay = self.harness.relay(mode)
        now = self.clock()
        expired = [
            m
            for m in self.messages.values()
            if m.state == "sending" and m.lease_until is not None and m.lease_until <= now
        ]
        verdicts: Sequence[tuple[str, str]] = []
        crashed = False
        try:
            with armed(crash):
                verdicts = relay.dispatch_once()
        except Crash:
            assert crash is not None
            crashed = True
            self.kills += 1
            if crash.endswith("sent_commit"):
                # The relay kept the turn it could not record, to record it again: a dead
                # process would not. Before that point it holds nothing in memory.
                self.harness.restart(mode)
        answers = self.harness.log.take()
        if expired:
            # A relay reaps expired leases at most every quarter lease of clock time, so
            # whether this turn did is read back; it is all of them or none.
            fences = {
                reply_id: row["fence"]
                for reply_id, row in self._snapshot(fresh=True).messages.items()
            }
            reaped = [m for m in expired if fences[m.reply_id] != m.fence]
            assert len(reaped) in (0, len(expired)), "the relay reaped some expired leases only"
            if reaped:
                self._reap_messages(now)
        claimed = self._deliverable(now)
        assert len(claimed) < RELAY_BATCH, "the model assumes one batch takes everything due"
        if not claimed:
            assert (crashed, verdicts, answers) == (False, [], []), (crashed, verdicts, answers)
            return 0
        assert crashed == (crash is not None), f"dispatch_once() did not reach {crash}"
        owner = RELAY_OWNERS[mode]
        deliver: list[MessageModel] = []
        resolve: list[MessageModel] = []
        for message in claimed:
            message.state = "sending"
            message.owner = owner
            message.lease_until = now + RELAY_LEASE
            message.fence += 1
            if message.attempts < RELAY_ATTEMPTS:
                message.attempts += 1
                deliver.append(message)
            else:
                resolve.append(message)  # budget spent: a receipt lookup decides
        if crash == "relay.after_claim":
            assert answers == [], answers
            return 0
        posted = sorted((r, a) for kind, r, a in answers if kind == "post")
        expected = sorted((m.reply_id, "duplicate" if m.received else "stored") for m in deliver)
        assert posted == expected, f"receiver answers {posted}, model {expected}"
        looked_up = sorted(r for kind, r, _ in answers if kind == "lookup")
        assert looked_up == sorted(m.reply_id for m in resolve), looked_up
        self.duplicates += sum(1 for _, a in posted if a == "duplicate")
        outcome: dict[str, str] = {}
        for message in deliver:
            message.received = True
            outcome[message.reply_id] = "sent"
        for message in resolve:
            outcome[message.reply_id] = "sent" if message.received else "dead"
        if crash in ("relay.after_remote_commit", "relay.before_sent_commit"):
            return 0  # nothing recorded: the rows stay leased until their lease expires
        for message in claimed:
            message.state = outcome[message.reply_id]
            message.lease_until = None
        if crash is not None:
            return 0  # relay.after_sent_commit: recorded, the verdicts never returned
        assert sorted(verdicts) == sorted(outcome.items()), verdicts
        return len(verdicts)

    # --- rules -------------------------------------------------------------------

    @rule(intake=INTAKES)
    @step
    def receive(self, intake: Intake) -> None:
        """Intake of a new, repeated or colliding envelope."""
        self._intake(self._envelope(intake), crash=None)

    @rule(where=st.sampled_from(["intake.before_commit", "intake.after_commit"]), intake=INTAKES)
    @step
    def crash_intake(self, where: str, intake: Intake) -> None:
        """Intake dies before or after its commit."""
        self._intake(self._envelope(intake), crash=where)

    @rule(target=claims, owner=st.sampled_from(OWNERS))
    @step
    def claim(self, owner: str) -> Any:
        """A worker claims the best task."""
        got = self._claim(owner)
        return multiple() if got is None else got

    @rule(
        where=st.sampled_from(["claim.before_commit", "claim.after_commit"]),
        owner=st.sampled_from(OWNERS),
    )
    @step
    def crash_claim(self, where: str, owner: str) -> None:
        """A worker dies inside its claim, before or after the commit."""
        self._claim(owner, crash=where)

    @rule(claim=claims)
    @step
    def renew(self, claim: Claim) -> None:
        """A heartbeat: accepted only for the claim that holds."""
        now = self.clock()
        holds = self._holds(claim, now)
        try:
            renewed = self.queue.renew(claim)
        except Fenced:
            assert not holds, "renew() refused a claim that holds"
            return
        assert holds, "renew() accepted a claim that does not hold"
        self._assert_newest(claim)
        task = self.tasks[claim.task_id]
        task.lease_until = now + TASK_LEASE
        assert renewed.lease_until == task.lease_until, renewed

    @rule(claim=claims, result=st.integers(0, 3))
    @step
    def finish(self, claim: Claim, result: int) -> None:
        """A worker commits its result."""
        self._finish(claim, {"r": result})

    @rule(
        where=st.sampled_from(["finish.before_commit", "finish.after_commit"]),
        claim=claims,
        result=st.integers(0, 3),
    )
    @step
    def crash_finish(self, where: str, claim: Claim, result: int) -> None:
        """A worker dies inside finish, before or after the commit."""
        self._finish(claim, {"r": result}, crash=where)

    @rule(claim=claims, permanent=st.booleans())
    @step
    def fail(self, claim: Claim, permanent: bool) -> None:
        """A worker fails its attempt: retried after backoff, or failed for good."""
        now = self.clock()
        holds = self._holds(claim, now)
        try:
            state = self.queue.fail(claim, "boom", permanent=permanent)
        except Fenced:
            assert not holds, "fail() refused a claim that holds"
            return
        assert holds, "fail() accepted a claim that does not hold"
        self._assert_newest(claim)
        task = self.tasks[claim.task_id]
        if permanent or task.attempts >= task.max_attempts:
            assert state == "failed", state
            code = "permanent_failure" if permanent else "attempts_exhausted"
            self._terminate(task, "failed", (code, "boom"))
            return
        assert state == "pending", state
        row = self.queue.task(task.task_id)
        assert row is not None
        ceiling = min(BACKOFF_CAP, BACKOFF * 2.0 ** (task.attempts - 1))
        assert now + ceiling / 2 <= row["available_at"] <= now + ceiling, (
            f"retry at {row['available_at'] - now}s, not in [{ceiling / 2}, {ceiling}]"
        )
        task.state = "pending"
        task.lease_until = None
        task.available_at = row["available_at"]

    @rule(
        source=st.sampled_from(SOURCES),
        message_id=st.sampled_from(MESSAGE_IDS),
        reason=st.sampled_from([None, "order withdrawn", "caf\u00e9 \U0001f600\x00end"]),
    )
    @step
    def cancel(self, source: str, message_id: str, reason: str | None) -> None:
        """Cancel: pending or running -> cancelled with its reply; otherwise False."""
        task = self.tasks.get(task_id_for(source, message_id))
        expected = task is not None and task.state in LIVE
        task_id = task_id_for(source, message_id)
        cancelled = (
            self.queue.cancel(task_id) if reason is None else self.queue.cancel(task_id, reason)
        )
        assert cancelled is expected
        if task is not None and expected:
            # NUL cannot be stored: it is kept as the four characters \x00.
            why = "cancelled" if reason is None else reason.replace("\x00", "\\x00")
            self._terminate(task, "cancelled", ("cancelled", why))

    # Hypothesis shrinks steps towards its first rule (no bundle, fewest arguments, then
    # name): that is this one, which touches no database, so shrinking runs fast.
    @rule()
    @step
    def advance_clock(self) -> None:
        """A second passes."""
        self.clock.advance(1.0)

    @rule(seconds=st.sampled_from([5.0, 0.5, TASK_LEASE, RELAY_LEASE + 1, 301.0]))
    @step
    def jump_clock(self, seconds: float) -> None:
        """Time passes (lease and deadline boundaries included)."""
        self.clock.advance(seconds)

    @rule()
    @step
    def reconcile(self) -> None:
        """Expire, reap task leases and delivery leases."""
        self._reconcile()

    @rule(
        reply_id=st.sampled_from(PUBLISH_IDS),
        variant=st.integers(0, 1),
        ordering_key=st.sampled_from(ORDERING_KEYS),
        rolled_back=st.booleans(),
    )
    @step
    def publish(
        self, reply_id: str, variant: int, ordering_key: str | None, rolled_back: bool
    ) -> None:
        """publish() in a caller's transaction: new, no-op repeat, collision, or rolled back."""
        body = canonical({"v": variant})
        known = self.messages.get(reply_id)
        collides = known is not None and (known.body, known.ordering_key) != (body, ordering_key)
        try:
            with Session(self.harness.engine) as session, session.begin():
                row = outbox.publish(
                    session,
                    destination="default",
                    reply_id=reply_id,
                    body={"v": variant},
                    ordering_key=ordering_key,
                    clock=self.clock,
                )
                if rolled_back:
                    raise CallerFailed
        except PayloadCollision:
            assert collides, "PayloadCollision for a new or identical message"
            return
        except CallerFailed:
            assert not collides, "publish() accepted another body under a stored reply_id"
            return  # the caller's transaction failed: its message must not exist
        assert not collides, "publish() accepted another body under a stored reply_id"
        if known is None:
            self.seq += 1
            known = self.messages[reply_id] = MessageModel(
                reply_id, None, body, ordering_key, available_at=self.clock(), seq=self.seq
            )
            self.published.add(reply_id)
        assert (row["reply_id"], row["state"], row["body"]) == (reply_id, known.state, body), row

    @rule(mode=st.sampled_from(MODES))
    @step
    def deliver(self, mode: str) -> None:
        """One relay turn: claim what is due, POST it, record the outcomes."""
        self._relay_turn(mode, crash=None)

    @rule(mode=st.sampled_from(MODES))
    @step
    def lose_ack(self, mode: str) -> None:
        """The receiver commits, the relay dies before recording the answer."""
        self._relay_turn(mode, crash="relay.after_remote_commit")

    @rule(
        mode=st.sampled_from(MODES),
        where=st.sampled_from(
            ["relay.after_claim", "relay.before_sent_commit", "relay.after_sent_commit"]
        ),
    )
    @step
    def crash_relay(self, mode: str, where: str) -> None:
        """The relay dies after claiming, or around recording its outcomes."""
        self._relay_turn(mode, crash=where)

    # --- invariants ----------------------------------------------------------------

    @invariant()
    @checked
    def database_equals_model(self) -> None:
        """Every row is what the model says: nothing of a rolled-back transaction shows."""
        snap = self._snapshot()
        problems = (
            differences("task", snap.tasks, {t: m.view() for t, m in self.tasks.items()})
            + differences("reply", snap.messages, {r: m.view() for r, m in self.messages.items()})
            + differences("inbox", snap.inbox, self.inbox)
            + differences(
                "receipt",
                snap.receipts,
                {r: sha256(m.body) for r, m in self.messages.items() if m.received},
            )
        )
        assert not problems, "\n".join(problems)

    @invariant()
    @checked
    def one_live_lease_per_task(self) -> None:
        """A running task is held by its newest claim only; every older claim is stale."""
        now = self.clock()
        snap = self._snapshot()
        for task_id, row in snap.tasks.items():
            if row["state"] == "running":
                newest = self.newest.get(task_id)
                assert (row["owner"], row["fence"]) == newest, f"{task_id} {row}, newest {newest}"
        for task_id, handed in self.handed.items():
            live = [c for c in handed if self._holds(c, now)]
            assert len(live) <= 1, f"task {task_id} has {len(live)} live claims"
            assert all((c.owner, c.fence) == self.newest[task_id] for c in live)

    @invariant()
    @checked
    def fences_only_increase(self) -> None:
        """Per task and per reply, a fence never goes down from one step to the next."""
        snap = self._snapshot()
        for seen, rows in (
            (self.seen_task_fences, snap.tasks),
            (self.seen_message_fences, snap.messages),
        ):
            for key, row in rows.items():
                assert row["fence"] >= seen.get(key, 0), f"fence of {key} went down"
                seen[key] = row["fence"]

    @invariant()
    @checked
    def attempts_within_budget(self) -> None:
        """Attempts never exceed max_attempts (tasks) or the relay's budget (replies)."""
        snap = self._snapshot()
        for task_id, row in snap.tasks.items():
            assert 0 <= row["attempts"] <= row["max_attempts"], (task_id, row)
        for reply_id, row in snap.messages.items():
            assert 0 <= row["attempts"] <= RELAY_ATTEMPTS, (reply_id, row)

    @invariant()
    @checked
    def one_reply_per_terminal_task(self) -> None:
        """A terminal task has exactly one reply, carrying its state; a live one has none."""
        snap = self._snapshot()
        replies = Counter(row["task_id"] for row in snap.messages.values() if row["task_id"])
        assert set(replies) <= set(snap.tasks), "a reply for a task that does not exist"
        for task_id, row in snap.tasks.items():
            assert replies[task_id] == (1 if row["state"] in TERMINAL else 0), (task_id, row)
            if row["state"] in TERMINAL:
                body = json.loads(snap.messages["reply:" + task_id]["body"])
                error = body.pop("error", None)
                assert body == {
                    "kind": "result",
                    "task_id": task_id,
                    "status": row["state"],
                    "result": row["result"],
                }, body
                if row["state"] == "done":
                    assert error is None, error
                else:
                    assert error["code"] in END_CODES[row["state"]], (task_id, error)
                    assert isinstance(error["reason"], str), error
                    assert error["reason"], error

    @invariant()
    @checked
    def one_effect_per_receipt(self) -> None:
        """Every receipt has exactly one effect, and no effect lacks its receipt."""
        snap = self._snapshot()
        assert snap.effects == dict.fromkeys(snap.receipts, 1), snap.effects

    # --- teardown ------------------------------------------------------------------

    def _drain(self) -> None:
        """Work every task to a final state, then deliver every reply, all model-checked."""
        for _ in range(10):
            # Each claim reconciles first: expired leases and deadlines settle on the way.
            while (got := self._claim("drainer")) is not None:
                self._finish(got, {"drained": True})
            if all(t.state in TERMINAL for t in self.tasks.values()):
                break
            self.clock.advance(BACKOFF_CAP + TASK_LEASE + 1)
        for _ in range(10):
            if any(m.state == "sending" for m in self.messages.values()):
                self.clock.advance(RELAY_LEASE + 1)
                self._reconcile()
            while self._relay_turn("single", crash=None):
                pass
            if all(m.state not in UNDELIVERED for m in self.messages.values()):
                break
        self.version += 1
        for check in (
            self.database_equals_model,
            self.one_live_lease_per_task,
            self.fences_only_increase,
            self.attempts_within_budget,
            self.one_reply_per_terminal_task,
            self.one_effect_per_receipt,
        ):
            check()

    def teardown(self) -> None:
        """Drain and run the shared checker, unless a step already failed."""
        if self.broken:
            return
        self._drain()
        found = tally(self.harness.url, acknowledged=self.acknowledged, published=self.published)
        found.assert_clean(dead_allowed=True)
        assert found.receipts == sum(m.received for m in self.messages.values())
        self.harness.add(found, self.kills, self.duplicates)


@pytest.fixture
def harness(backend: str, db_url: str) -> Iterator[Harness]:
    """Engines, a snapshot reader and one observed reference receiver on the test database."""
    engine = outbox.create_engine(db_url)
    # The relay's pool as Relay(url) would open it (no ping per checkout), shared by the
    # relays of every example.
    relay_engine = outbox.create_engine(db_url, pool_pre_ping=False)
    # Nothing writes while a snapshot reads, so its queries need no common transaction.
    reader_engine = sa.create_engine(
        engine.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
    )
    reader = reader_engine.raw_connection()
    store = ReceiptStore(db_url)
    log = AnswerLog(create_app(store, [SECRET], effect=record_effect))
    try:
        with ReceiverThread(log) as server:
            shared = Harness(backend, db_url, engine, relay_engine, reader, log, server.base)
            try:
                yield shared
            finally:
                shared.close()
    finally:
        store.close()
        reader.close()
        for disposable in (reader_engine, relay_engine, engine):
            disposable.dispose()


def test_queue_outbox_and_delivery_follow_the_model(
    backend: str, harness: Harness, soak: bool
) -> None:
    """Random programs of intake, claims, crashes, time and delivery never break the model."""
    examples, steps = PROFILES[backend]
    if soak:
        examples *= SOAK_FACTOR
    machine = type(f"ModelMachine_{backend}", (ModelMachine,), {"harness": harness})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            print_blob=True,
            database=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
                HealthCheck.filter_too_much,
            ],
        ),
    )
    record_then_assert(
        "model",
        backend,
        "state machine",
        runs=harness.runs,
        kills=harness.kills,
        messages=harness.delivered,
        found=harness.found,
        dead_allowed=True,
    )
    assert harness.runs >= examples, harness.runs
    # The run must have reached the paths it is about, or it proves little.
    assert harness.kills > 0, "no crash was ever injected"
    assert harness.duplicates > 0, "no resend after a lost ACK was ever answered duplicate"
