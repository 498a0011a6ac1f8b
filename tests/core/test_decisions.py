"""outbox.decisions: requeue and resolve as core operations, each message's outcome a record.

Called directly, with an injected receipt lookup, as both front ends call them; nothing
is printed. The command's renderings of the same records are tested through `outbox dead
requeue|resolve` (tests/test_cli_operations.py, tests/test_dead_resolve.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from support.operations_helpers import audit_rows, dead_messages, mark_dead, mark_resolved
from support.relay_helpers import publish_many, rows

import outbox
from outbox import decisions
from outbox.dead_filter import DeadFilter
from outbox.decisions import REFUSALS, Decision, RequeueDecision
from outbox.errors import NotDead
from outbox.operations import Operations
from outbox.schema import messages
from outbox.testing import ManualClock

BILLING = DeadFilter(destination="billing")


@pytest.fixture
def backend() -> str:
    """The decisions are plain Python over Operations: one backend is enough here."""
    return "sqlite"


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


@pytest.fixture
def ops(db_url: str, engine: sa.Engine, clock: ManualClock) -> Iterator[Operations]:
    """Operations on four dead messages (b-1, b-2 to billing, s-1, s-2 to shipping)."""
    dead_messages(engine, clock)
    with Operations(db_url, clock=clock) as operations:
        yield operations


class Lookup:
    """A receipt lookup answering from a table, recording what it was asked."""

    def __init__(self, answers: Mapping[str, str]) -> None:
        self.answers = answers
        self.asked: list[list[str]] = []

    def __call__(self, messages: Sequence[Mapping[str, Any]]) -> list[str]:
        self.asked.append([m["reply_id"] for m in messages])
        for message in messages:
            assert {"destination", "content_hash"} <= set(message)
        return [self.answers[m["reply_id"]] for m in messages]


def states(engine: sa.Engine) -> dict[str, str]:
    """Every message's state by reply_id."""
    return {reply_id: row["state"] for reply_id, row in rows(engine).items()}


def test_a_filtered_requeue_asks_once_then_requeues_what_the_lookup_allows(
    ops: Operations, engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    lookup = Lookup({"b-1": "not received", "b-2": "received"})
    done = decisions.requeue(ops, BILLING, reason="billing is back", by="anna", lookup=lookup)
    assert lookup.asked == [["b-1", "b-2"]]  # all at once, oldest first
    [first, second] = done
    assert (first.reply_id, first.outcome, first.receipt, first.why) == (
        "b-1",
        "requeued",
        "not received",
        None,
    )
    assert first.audit is not None
    assert (first.audit["receipt"], first.audit["forced"], first.audit["requested_by"]) == (
        "not received",
        False,
        "anna",
    )
    assert first.audit["reason"] == "billing is back"
    assert (second.outcome, second.why, second.audit) == ("refused", REFUSALS["received"], None)
    assert second.forceable
    assert not first.forceable
    assert states(engine) == {"b-1": "pending", "b-2": "dead", "s-1": "dead", "s-2": "dead"}
    assert [a["reply_id"] for a in audit_rows(engine)] == ["b-1"]
    assert capsys.readouterr() == ("", "")  # the front ends say it, not the core


@pytest.mark.parametrize("answer", sorted(REFUSALS))
def test_each_refusing_answer_refuses_unless_forced(
    ops: Operations, engine: sa.Engine, answer: str
) -> None:
    lookup = Lookup({"s-1": answer})
    [refused] = decisions.requeue(ops, "s-1", reason="r", by="anna", lookup=lookup)
    assert (refused.outcome, refused.why, refused.receipt) == ("refused", REFUSALS[answer], answer)
    assert states(engine)["s-1"] == "dead"
    [forced] = decisions.requeue(ops, "s-1", reason="r", by="anna", lookup=lookup, force=True)
    assert forced.outcome == "requeued"
    assert forced.audit is not None
    assert (forced.audit["receipt"], forced.audit["forced"]) == (answer, True)
    assert states(engine)["s-1"] == "pending"


def test_overriding_forces_past_that_answer_only(ops: Operations, engine: sa.Engine) -> None:
    lookup = Lookup({"s-1": "received"})
    [other] = decisions.requeue(
        ops, "s-1", reason="r", by="anna", lookup=lookup, overriding="unknown"
    )
    assert (other.outcome, other.why) == ("refused", REFUSALS["received"])
    assert states(engine)["s-1"] == "dead"
    [confirmed] = decisions.requeue(
        ops, "s-1", reason="r", by="anna", lookup=lookup, overriding="received"
    )
    assert confirmed.outcome == "requeued"
    assert confirmed.audit is not None
    assert confirmed.audit["forced"] is True


def test_without_a_lookup_nothing_is_checked_and_everything_refused(
    ops: Operations, engine: sa.Engine
) -> None:
    done = decisions.requeue(ops, DeadFilter(destination="shipping"), reason="r", by="anna")
    assert [(d.reply_id, d.outcome, d.receipt) for d in done] == [
        ("s-1", "refused", "not checked"),
        ("s-2", "refused", "not checked"),
    ]
    assert all(d.why == REFUSALS["not checked"] for d in done)
    assert audit_rows(engine) == []


def test_a_dry_run_asks_and_changes_nothing(ops: Operations, engine: sa.Engine) -> None:
    lookup = Lookup({"b-1": "not received", "b-2": "unknown"})
    done = decisions.requeue(
        ops, BILLING, reason="r", by="anna", lookup=lookup, dry_run=True, force=True
    )
    assert [(d.outcome, d.receipt, d.audit) for d in done] == [
        ("would requeue", "not received", None),
        ("would requeue", "unknown", None),
    ]
    assert lookup.asked == [["b-1", "b-2"]]
    assert set(states(engine).values()) == {"dead"}
    assert audit_rows(engine) == []


def test_the_limit_and_progress(ops: Operations) -> None:
    told: list[tuple[int, int]] = []
    lookup = Lookup(dict.fromkeys(["b-1", "b-2", "s-1", "s-2"], "not received"))
    done = decisions.requeue(
        ops,
        DeadFilter(error="HTTP"),
        reason="r",
        by="anna",
        lookup=lookup,
        limit=2,
        progress=lambda i, n: told.append((i, n)),
    )
    assert [d.reply_id for d in done] == ["b-1", "b-2"]
    assert told == [(1, 2), (2, 2)]


def test_a_reply_id_that_is_no_dead_message_is_refused_before_anything_is_asked(
    ops: Operations, engine: sa.Engine, clock: ManualClock
) -> None:
    publish_many(engine, ["pending-1"], clock=clock)
    mark_resolved(engine, {"b-1": clock()})
    lookup = Lookup({})
    for reply_id, state in [("nope", None), ("pending-1", "pending"), ("b-1", "resolved")]:
        with pytest.raises(NotDead) as requeue_refused:
            decisions.requeue(ops, reply_id, reason="r", by="anna", lookup=lookup)
        with pytest.raises(NotDead) as resolve_refused:
            decisions.resolve(ops, reply_id, reason="r", by="anna")
        for refused in (requeue_refused.value, resolve_refused.value):
            assert (refused.reply_id, refused.state) == (reply_id, state)
    assert lookup.asked == []
    assert audit_rows(engine) == []


def test_a_lookup_must_answer_each_message_with_a_known_answer(
    ops: Operations, engine: sa.Engine
) -> None:
    def too_few(messages: Sequence[Mapping[str, Any]]) -> list[str]:
        return ["not received"]

    with pytest.raises(ValueError, match="1 answers for 2"):
        decisions.requeue(ops, BILLING, reason="r", by="anna", lookup=too_few)
    with pytest.raises(ValueError, match="receipt must be one of"):
        decisions.requeue(ops, "b-1", reason="r", by="anna", lookup=Lookup({"b-1": "yes"}))
    assert audit_rows(engine) == []
    assert set(states(engine).values()) == {"dead"}


@pytest.mark.parametrize(
    ("reason", "by", "said"),
    [(" ", "anna", "a reason is required"), ("why", "", "who decides must be named")],
)
def test_a_decision_needs_a_reason_and_an_operator(
    ops: Operations, engine: sa.Engine, reason: str, by: str, said: str
) -> None:
    lookup = Lookup({"b-1": "not received"})
    with pytest.raises(ValueError, match=said):
        decisions.requeue(ops, "b-1", reason=reason, by=by, lookup=lookup)
    with pytest.raises(ValueError, match=said):
        decisions.resolve(ops, "b-1", reason=reason, by=by)
    assert lookup.asked == []
    assert set(states(engine).values()) == {"dead"}


def test_resolve_settles_the_chosen_asking_nothing(ops: Operations, engine: sa.Engine) -> None:
    done = decisions.resolve(ops, BILLING, reason="confirmed by phone", by="anna")
    assert [(d.reply_id, d.outcome, d.why) for d in done] == [
        ("b-1", "resolved", None),
        ("b-2", "resolved", None),
    ]
    assert all(type(d) is Decision for d in done)  # no receipt: nothing was asked
    audits = audit_rows(engine)
    assert [(a["reply_id"], a["action"], a["receipt"]) for a in audits] == [
        ("b-1", "resolve", "not checked"),
        ("b-2", "resolve", "not checked"),
    ]
    assert [d.audit for d in done] == audits
    assert states(engine) == {"b-1": "resolved", "b-2": "resolved", "s-1": "dead", "s-2": "dead"}


def test_a_dry_run_resolve_changes_nothing(ops: Operations, engine: sa.Engine) -> None:
    [one] = decisions.resolve(ops, "s-2", reason="r", by="anna", dry_run=True)
    assert (one.reply_id, one.outcome, one.audit) == ("s-2", "would resolve", None)
    assert states(engine)["s-2"] == "dead"
    assert audit_rows(engine) == []


def test_a_message_decided_meanwhile_is_refused_with_the_reason(
    ops: Operations, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = decisions.chosen_messages

    def chosen_then_resolved(*args: Any) -> list[dict[str, Any]]:
        found = chosen(*args)
        mark_resolved(engine, {"b-1": 0.0})  # by someone else, between choice and decision
        return found

    monkeypatch.setattr(decisions, "chosen_messages", chosen_then_resolved)
    [requeued] = decisions.requeue(
        ops, "b-1", reason="r", by="anna", lookup=Lookup({"b-1": "not received"})
    )
    assert isinstance(requeued, RequeueDecision)
    assert (requeued.outcome, requeued.receipt, requeued.audit) == (
        "refused",
        "not received",
        None,
    )
    assert requeued.why == "message 'b-1' is resolved, which is final; nothing requeued"
    assert not requeued.forceable  # no force overrides a refusal the database gave
    mark_dead(engine, "b-1")
    [resolved] = decisions.resolve(ops, "b-1", reason="r", by="anna")
    assert (resolved.outcome, resolved.why) == (
        "refused",
        ("message 'b-1' is resolved, which is final; nothing resolved"),
    )


def test_a_bulk_decision_runs_a_few_statements_a_batch_not_a_few_a_message(
    ops: Operations, engine: sa.Engine, clock: ManualClock
) -> None:
    chosen = [f"bulk-{n}" for n in range(decisions.PER_TRANSACTION + 50)]
    publish_many(engine, chosen, destination="bulk", clock=clock)
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages).where(messages.c.destination == "bulk").values(state="dead")
        )
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    sa.event.listen(ops.engine, "before_cursor_execute", count)
    try:
        every = dict.fromkeys(chosen, "not received")
        requeued = decisions.requeue(
            ops, DeadFilter(destination="bulk"), reason="r", by="anna", lookup=Lookup(every)
        )
    finally:
        sa.event.remove(ops.engine, "before_cursor_execute", count)
    assert [d.outcome for d in requeued] == ["requeued"] * len(chosen)
    assert [d.audit["reply_id"] for d in requeued if d.audit] == chosen
    assert {states(engine)[reply_id] for reply_id in chosen} == {"pending"}
    # Two batches: the list, then per batch a lock, an update, the audits and a BEGIN.
    assert len(statements) <= 1 + 2 * 5, statements
