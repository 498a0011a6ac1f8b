"""The invariant checker: reads the outbox and receiver databases after a run.

Per reply_id it counts what the product promises never happens:
- lost: an acknowledged task or committed reply with no terminal outcome and
  no receipt, a terminal task without its reply, a `sent` reply the receiver
  does not hold, or a receipt without its effect;
- duplicated: more than one effect row for one reply_id (a task has one reply
  at most: a unique index holds that);
- stuck: a task or reply that is neither finished nor dead after draining;
- unexpected: a receipt with no outbox row, or with another body's hash, or an
  effect without its receipt;
- orphaned: a row whose partner, which the schema does not enforce (it has no
  foreign keys), is missing: a task without its inbox row, a task reply whose
  task is gone, a requeue record whose reply is gone.
- out of order: a message with an ordering key whose effect the receiver applied
  after the effect of a later message (a higher outbox id) of the same destination
  and key; the order applied is the effects table's identity order, and only a
  message's first effect counts (a second one is counted as duplicated).
`dead` replies are counted apart: a scenario says whether it allows them.
Every figure is measured by `tally()`; a test records them (faults.figures)
before it asserts, so the report shows what was found, not what was hoped.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import sqlalchemy as sa

import outbox
from outbox.states import TERMINAL_TASK_STATES

LIVE_MESSAGE_STATES = ("pending", "sending")


@dataclass
class Tally:
    """What the checker found; `problems` names the first offending rows."""

    tasks: int = 0
    messages: int = 0
    receipts: int = 0
    lost: int = 0
    duplicated: int = 0
    stuck: int = 0
    unexpected: int = 0
    orphaned: int = 0
    dead: int = 0
    keyed: int = 0
    """Messages with an ordering key: those whose order was checked."""
    out_of_order: int = 0
    problems: list[str] = field(default_factory=list)

    def note(self, kind: str, what: str) -> None:
        """Count one problem of `kind` and remember the first few."""
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {what}")

    @property
    def settled(self) -> bool:
        """Nothing is left to do: nothing stuck, every sent reply received."""
        return self.stuck == 0 and self.lost == 0

    def broken(self, dead_allowed: bool = False) -> dict[str, int]:
        """The non-zero counts among lost, duplicated, stuck, unexpected, orphaned, out of
        order (and dead, unless allowed)."""
        counts = {
            "lost": self.lost,
            "duplicated": self.duplicated,
            "stuck": self.stuck,
            "unexpected": self.unexpected,
            "orphaned": self.orphaned,
            "out_of_order": self.out_of_order,
        }
        if not dead_allowed:
            counts["dead"] = self.dead
        return {k: v for k, v in counts.items() if v}

    def assert_clean(self, dead_allowed: bool = False) -> None:
        """Fail unless lost, duplicated, stuck, unexpected, orphaned, out of order (and dead,
        unless allowed) are 0."""
        broken = self.broken(dead_allowed)
        assert not broken, f"invariants broken: {broken}; {self.problems}"


def tally(
    outbox_url: str,
    receiver_url: str | None = None,
    *,
    acknowledged: Iterable[tuple[str, str]] = (),
    published: Iterable[str] = (),
) -> Tally:
    """Count the invariants now; `acknowledged`: (principal, message_id) pairs ACKed."""
    found = Tally()
    out_engine = outbox.create_engine(outbox_url)
    rec_engine = (
        out_engine
        if receiver_url in (None, outbox_url)
        else outbox.create_engine(str(receiver_url))
    )
    try:
        with out_engine.connect() as conn:
            inbox = {
                (r.principal, r.message_id): r.task_id
                for r in conn.execute(
                    sa.text("SELECT principal, message_id, task_id FROM outbox_inbox")
                )
            }
            tasks = dict(conn.execute(sa.text("SELECT task_id, state FROM outbox_tasks")).all())
            messages = {
                r.reply_id: r
                for r in conn.execute(
                    sa.text(
                        "SELECT id, reply_id, task_id, state, content_hash, destination, "
                        "ordering_key FROM outbox_messages"
                    )
                )
            }
            requeued = set(
                conn.execute(sa.text("SELECT DISTINCT reply_id FROM outbox_requeues")).scalars()
            )
        with rec_engine.connect() as conn:
            receipts = dict(
                conn.execute(sa.text("SELECT reply_id, content_hash FROM receiver_receipts")).all()
            )
            # In the order the receiver applied them: the identity column's.
            applied = list(
                conn.execute(sa.text("SELECT reply_id FROM receiver_effects ORDER BY id")).scalars()
            )
            effects = Counter(applied)
    finally:
        out_engine.dispose()
        if rec_engine is not out_engine:
            rec_engine.dispose()

    found.tasks, found.messages, found.receipts = len(tasks), len(messages), len(receipts)
    replies_by_task = {m.task_id: m.reply_id for m in messages.values() if m.task_id is not None}
    for key in acknowledged:
        if key not in inbox:
            found.note("lost", f"acknowledged message {key} has no inbox row")
    for task_id in set(inbox.values()) - set(tasks):
        found.note("lost", f"inbox row for task {task_id} has no task")
    for task_id in set(tasks) - set(inbox.values()):
        found.note("orphaned", f"task {task_id} has no inbox row")
    for task_id, reply_id in replies_by_task.items():
        if task_id not in tasks:
            found.note("orphaned", f"reply {reply_id} names task {task_id}, which is gone")
    for reply_id in requeued - set(messages):
        found.note("orphaned", f"requeue record for {reply_id} has no outbox row")
    for task_id, state in tasks.items():
        if state not in TERMINAL_TASK_STATES:
            found.note("stuck", f"task {task_id} is {state}")
        elif task_id not in replies_by_task:
            found.note("lost", f"task {task_id} is {state} without a reply")
    for reply_id in published:
        if reply_id not in messages:
            found.note("lost", f"published reply {reply_id} has no outbox row")
    for reply_id, message in messages.items():
        if message.state in LIVE_MESSAGE_STATES:
            found.note("stuck", f"reply {reply_id} is {message.state}")
        elif message.state in ("dead", "resolved"):
            # Not delivered by the relay: dead, or dead and then settled by an operator.
            found.dead += 1
        elif reply_id not in receipts:
            found.note("lost", f"reply {reply_id} is sent but the receiver has no receipt")
    for reply_id, content_hash in receipts.items():
        message = messages.get(reply_id)
        if message is None:
            found.note("unexpected", f"receipt {reply_id} has no outbox row")
        elif content_hash != message.content_hash:
            found.note("unexpected", f"receipt {reply_id} holds another body")
        if effects[reply_id] == 0:
            found.note("lost", f"receipt {reply_id} has no effect")
    for reply_id, count in effects.items():
        if count > 1:
            found.note("duplicated", f"reply {reply_id} has {count} effects")
        if reply_id not in receipts:
            found.note("unexpected", f"effect for {reply_id} has no receipt")
    keyed = {
        reply_id: (m.destination, m.ordering_key, int(m.id))
        for reply_id, m in messages.items()
        if m.ordering_key is not None
    }
    found.keyed = len(keyed)
    for problem in out_of_order(keyed, applied):
        found.note("out_of_order", problem)
    return found


def out_of_order(keyed: Mapping[str, tuple[str, str, int]], applied: Iterable[str]) -> list[str]:
    """Each keyed message applied after a later message of its destination and key.

    `keyed`: reply_id -> (destination, ordering key, outbox id) of each message with a
    key; `applied`: reply_ids in the order the receiver applied their effects (others
    are skipped). A message's first effect is the one that counts.
    """
    latest: dict[tuple[str, str], tuple[int, str]] = {}
    seen: set[str] = set()
    found = []
    for reply_id in applied:
        if reply_id in seen or reply_id not in keyed:
            continue
        seen.add(reply_id)
        destination, key, position = keyed[reply_id]
        before = latest.get((destination, key))
        if before is not None and before[0] > position:
            found.append(f"{reply_id} (key {key}) applied after {before[1]}, later in its key")
        else:
            latest[destination, key] = (position, reply_id)
    return found


def drain(
    outbox_url: str,
    receiver_url: str | None = None,
    *,
    timeout: float = 60.0,
    acknowledged: Iterable[tuple[str, str]] = (),
    published: Iterable[str] = (),
    interval: float = 0.1,
    watch: Callable[[], None] | None = None,
) -> Tally:
    """Poll until the run has settled (or `timeout` passes); returns the last tally.

    `watch` runs at every poll and may raise, e.g. when a process that should
    be working has died, rather than waiting out the timeout.
    """
    acknowledged, published = list(acknowledged), list(published)
    deadline = time.monotonic() + timeout
    while True:
        if watch is not None:
            watch()
        found = tally(outbox_url, receiver_url, acknowledged=acknowledged, published=published)
        if found.settled or time.monotonic() >= deadline:
            return found
        time.sleep(interval)
