"""Keyed claims: the first undelivered message of a key brings its key's next ones along."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from support.relay_helpers import SECRET, publish_many, rows

from outbox.schema import messages
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.policy import Sent

NOWHERE = "http://127.0.0.1:9/replies"  # claims only: nothing is posted

SKIP_LOCKED_BACKENDS = ["postgresql", pytest.param("mysql", marks=pytest.mark.mysql)]
"""The backends whose claims lock rows and skip those another claim holds."""


@pytest.fixture
def relay_factory(db_url: str, clock: ManualClock) -> Iterator[Callable[..., Relay]]:
    """Relays on the test database that are only asked to claim and settle."""
    made: list[Relay] = []

    def make(owner: str = "relay-1", **options: object) -> Relay:
        relay = Relay(
            db_url,
            {"default": make_destination(NOWHERE, secret=SECRET)},
            owner=owner,
            clock=clock,
            **options,  # type: ignore[arg-type]
        )
        made.append(relay)
        return relay

    yield make
    for relay in made:
        relay.close()


def claimed_ids(relay: Relay) -> list[str]:
    """The reply_ids one claim leases (to deliver or to resolve), in id order."""
    deliver, resolve = relay.leases.claim()
    return [m.reply_id for m in sorted([*deliver, *resolve], key=lambda m: m.id)]


def change(engine: sa.Engine, reply_id: str, **values: object) -> None:
    """Set columns of one message directly, as a retry or an expired lease would."""
    with engine.begin() as conn:
        conn.execute(sa.update(messages).where(messages.c.reply_id == reply_id).values(**values))


def test_a_claim_takes_a_keys_next_messages_with_its_first(
    engine: sa.Engine, clock: ManualClock, relay_factory: Callable[..., Relay]
) -> None:
    publish_many(engine, ["a-1", "a-2", "a-3"], ordering_key="A", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)
    publish_many(engine, ["b-1", "b-2"], ordering_key="B", clock=clock)
    publish_many(engine, ["other-1", "other-2"], destination="other", ordering_key="A", clock=clock)
    relay = relay_factory()
    assert claimed_ids(relay) == ["a-1", "a-2", "a-3", "free-1", "b-1", "b-2"]
    # The same key for another destination is another key, and not this relay's.
    assert {r: row["state"] for r, row in rows(engine).items() if r.startswith("other")} == {
        "other-1": "pending",
        "other-2": "pending",
    }
    assert claimed_ids(relay) == []


@pytest.mark.parametrize(
    ("breaker", "values"),
    [
        ("retried with a backoff", {"available_at": 10**7}),
        ("spent (its lease expired with no attempts left)", {"attempts": 3}),
        ("sending (a lower id requeued behind it)", {"state": "sending", "lease_until": 10**7}),
        ("dead", {"state": "dead"}),
    ],
    ids=["not-due", "spent", "sending", "dead"],
)
def test_a_chain_stops_at_the_first_message_that_may_not_go(
    engine: sa.Engine,
    clock: ManualClock,
    relay_factory: Callable[..., Relay],
    breaker: str,
    values: dict[str, object],
) -> None:
    publish_many(engine, [f"k-{n}" for n in range(1, 6)], ordering_key="K", clock=clock)
    change(engine, "k-3", **values)
    relay = relay_factory(max_attempts=3)
    if values.get("state") == "dead":
        # A dead message holds no key, so it ends no chain either: the index has no
        # entry for it and the key's next message follows.
        assert claimed_ids(relay) == ["k-1", "k-2", "k-4", "k-5"], breaker
    else:
        assert claimed_ids(relay) == ["k-1", "k-2"], breaker
    assert rows(engine)["k-4"]["state"] in ("pending", "sending")


def test_a_spent_first_message_brings_no_successor(
    engine: sa.Engine, clock: ManualClock, relay_factory: Callable[..., Relay]
) -> None:
    # A spent message is only resolved, after the turn's sends: its successors wait for it.
    publish_many(engine, ["k-1", "k-2"], ordering_key="K", clock=clock)
    change(engine, "k-1", attempts=3)
    relay = relay_factory(max_attempts=3)
    deliver, resolve = relay.leases.claim()
    assert ([m.reply_id for m in deliver], [m.reply_id for m in resolve]) == ([], ["k-1"])
    assert rows(engine)["k-2"]["state"] == "pending"


def test_chains_share_the_claims_limit_rank_by_rank(
    engine: sa.Engine, clock: ManualClock, relay_factory: Callable[..., Relay]
) -> None:
    publish_many(engine, [f"a-{n}" for n in range(1, 9)], ordering_key="A", clock=clock)
    publish_many(engine, [f"b-{n}" for n in range(1, 9)], ordering_key="B", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)
    relay = relay_factory(batch=8)
    # Three first messages; the five left go to second messages, then to thirds, then to
    # fourths in claim order (A's first is older): each key's part is the start of its
    # chain, and both keys move.
    assert claimed_ids(relay) == ["a-1", "a-2", "a-3", "a-4", "b-1", "b-2", "b-3", "free-1"]


@pytest.mark.parametrize("backend", SKIP_LOCKED_BACKENDS, indirect=True)
def test_a_successor_is_never_claimed_while_another_claim_holds_its_first(
    engine: sa.Engine, clock: ManualClock, relay_factory: Callable[..., Relay]
) -> None:
    publish_many(engine, ["k-1", "k-2", "k-3"], ordering_key="K", clock=clock)
    publish_many(engine, ["free-1"], clock=clock)
    relay = relay_factory()
    with engine.connect() as holder, holder.begin():
        # Another claim's transaction has locked k-1 (FOR UPDATE SKIP LOCKED skips it).
        holder.execute(
            sa.select(messages.c.id).where(messages.c.reply_id == "k-1").with_for_update()
        )
        assert claimed_ids(relay) == ["free-1"]
    assert claimed_ids(relay) == ["k-1", "k-2", "k-3"]


@pytest.mark.parametrize("backend", SKIP_LOCKED_BACKENDS, indirect=True)
def test_two_concurrent_claimers_never_split_a_key(
    engine: sa.Engine, clock: ManualClock, relay_factory: Callable[..., Relay]
) -> None:
    keys = [f"key{k}" for k in range(4)]
    for key in keys:
        publish_many(engine, [f"{key}-{n:02d}" for n in range(30)], ordering_key=key, clock=clock)
    relays = [relay_factory(f"relay-{n}", batch=7) for n in range(2)]
    start = threading.Barrier(2, timeout=30)
    turn = threading.Condition()
    claims = [0, 0]
    done = [False, False]
    holders: dict[str, str] = {}
    parts: dict[str, list[list[str]]] = defaultdict(list)
    faults: list[str] = []
    errors: list[BaseException] = []

    def drain(n: int) -> None:
        relay, other = relays[n], 1 - n
        try:
            start.wait()
            idle = 0
            while idle < 3:
                deliver, _ = relay.leases.claim()
                idle = 0 if deliver else idle + 1
                by_key: dict[str, list[str]] = defaultdict(list)
                for message in sorted(deliver, key=lambda m: m.id):
                    by_key[str(message.ordering_key)].append(message.reply_id)
                with turn:
                    claims[n] += 1
                    turn.notify_all()
                    for key, ids in by_key.items():
                        if key in holders:
                            faults.append(
                                f"{relay.owner} took {ids} while {holders[key]} held {key}"
                            )
                        holders[key] = relay.owner
                        parts[key].append(ids)
                    # Hold the keys, their messages `sending`, until the other claimer has
                    # claimed once more: each claim then runs while the other holds keys.
                    seen = claims[other]

                    def moved(seen: int = seen) -> bool:
                        return claims[other] > seen or done[other]

                    turn.wait_for(moved, timeout=30)
                    for key in by_key:
                        holders.pop(key, None)
                relay.leases.settle(deliver, {m.id: Sent(200) for m in deliver})
        except BaseException as exc:
            errors.append(exc)
        finally:
            with turn:
                done[n] = True
                turn.notify_all()

    threads = [threading.Thread(target=drain, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert faults == []
    for key in keys:
        # Each key's parts, in the order they were claimed, are its messages in order,
        # each exactly once: no part skipped ahead of a message another claimer held.
        taken = [reply_id for part in parts[key] for reply_id in part]
        assert taken == [f"{key}-{n:02d}" for n in range(30)], parts[key]
    assert any(len(part) > 1 for key in keys for part in parts[key])
    assert {row["state"] for row in rows(engine).values()} == {"sent"}
