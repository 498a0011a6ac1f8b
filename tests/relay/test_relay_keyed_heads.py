"""The pick of keys' first messages: a walk of a bounded number of keys per claim, from
where the relay's previous walk stopped (outbox.drivers.postgresql.key_walk and
outbox.drivers.mysql.key_walk); PostgreSQL's spreading of long keys over claims
(KeyWalk.heads) last."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from support.relay_helpers import SECRET, rows

from outbox.drivers import driver_for
from outbox.drivers.postgresql.claims import KEY_ROUNDS
from outbox.drivers.records import FIRST_HEADS, KEY_WALK, ClaimedRow, KeyWalk
from outbox.schema import messages
from outbox.testing import ManualClock
from relay import Relay, make_destination
from relay.policy import Sent

NOWHERE = "http://127.0.0.1:9/replies"  # claims only: nothing is posted
BATCH = 4
CAP = KEY_WALK * BATCH  # keys one claim's walk visits at most

WALKING = ["postgresql", pytest.param("mysql", marks=pytest.mark.mysql)]
"""The backends whose claims walk keys from a cursor."""


@pytest.fixture
def relay(db_url: str, clock: ManualClock) -> Iterator[Relay]:
    """A relay on the test database that is only asked to claim and settle."""
    made = Relay(
        db_url, {"default": make_destination(NOWHERE, secret=SECRET)}, clock=clock, batch=BATCH
    )
    yield made
    made.close()


def insert(engine: sa.Engine, clock: ManualClock, *pairs: tuple[str, str | None]) -> None:
    """Pending messages (reply_id, ordering key), due now, in one transaction, in order."""
    now = clock()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(messages),
            [
                {
                    "reply_id": reply_id,
                    "destination": "default",
                    "ordering_key": key,
                    "body": b"{}",
                    "content_hash": "h",
                    "headers": "{}",
                    "state": "pending",
                    "attempts": 0,
                    "fence": 0,
                    "available_at": now,
                    "created_at": now,
                }
                for reply_id, key in pairs
            ],
        )


def claim_and_send(relay: Relay) -> list[str]:
    """One claim, its messages then settled as sent; their reply_ids in id order."""
    deliver, resolve = relay.leases.claim()
    assert not resolve
    relay.leases.settle(deliver, {m.id: Sent(200) for m in deliver})
    return [m.reply_id for m in sorted(deliver, key=lambda m: m.id)]


@pytest.mark.parametrize("backend", WALKING, indirect=True)
def test_a_key_that_sorts_last_is_reached_while_keys_that_sort_first_keep_receiving(
    engine: sa.Engine, clock: ManualClock, relay: Relay
) -> None:
    # Twenty keys that sort before "zz" each have a backlog, older than zz's message, and
    # a new message after every claim. Claims in claim order alone reach zz only after
    # the older backlog (some 15 claims); a walk from the first key at every claim never.
    first = [f"a{n:02d}" for n in range(20)]
    insert(engine, clock, *((f"{key}-{n}", key) for n in range(3) for key in first))
    insert(engine, clock, ("zz-0", "zz"))
    bound = -(-(len(first) + 1) // BATCH) + 1  # claims to pass every key once, and one
    for claim in range(1, bound + 1):
        if "zz-0" in claim_and_send(relay):
            break
        insert(engine, clock, *((f"{key}-new-{claim}", key) for key in first))
    else:
        pytest.fail(f"zz's message was not claimed within {bound} claims")


@pytest.mark.parametrize("backend", WALKING, indirect=True)
def test_a_destination_with_three_times_the_cap_of_keys_drains(
    engine: sa.Engine, clock: ManualClock, relay: Relay
) -> None:
    # The first two thirds of the keys start with a message retried with a backoff: a walk
    # that visits only the cap of keys from the first key would never reach the rest.
    keys = [f"k{n:03d}" for n in range(3 * CAP)]
    insert(engine, clock, *((f"{key}-{n}", key) for key in keys for n in range(2)))
    held = keys[: 2 * CAP]
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.reply_id.in_([f"{key}-0" for key in held]))
            .values(available_at=clock() + 60)
        )
    free = {f"{key}-{n}" for key in keys[2 * CAP :] for n in range(2)}
    claimed: list[str] = []
    bound = 2 * -(-len(keys) // BATCH)  # two laps of the keys, a batch of them a claim
    for _ in range(bound):
        claimed += claim_and_send(relay)
        if free <= set(claimed):
            break
    assert sorted(claimed) == sorted(free)
    clock.advance(61)
    idle = 0
    while idle < 3:
        sent = claim_and_send(relay)
        claimed += sent
        idle = 0 if sent else idle + 1
    assert {row["state"] for row in rows(engine).values()} == {"sent"}
    for key in keys:
        mine = [r for r in claimed if r.startswith(f"{key}-")]
        assert mine == [f"{key}-0", f"{key}-1"], (key, mine)


@pytest.mark.parametrize("backend", WALKING, indirect=True)
def test_unkeyed_messages_are_not_held_behind_keys_whose_first_is_sending(
    engine: sa.Engine, clock: ManualClock, relay: Relay
) -> None:
    insert(engine, clock, *((f"{key}-{n}", key) for key in ("a", "b", "c") for n in range(50)))
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.reply_id.in_(["a-0", "b-0", "c-0"]))
            .values(state="sending", owner="relay-2", lease_until=clock() + 60)
        )
    insert(engine, clock, ("free-0", None), ("free-1", None))
    assert claim_and_send(relay) == ["free-0", "free-1"]
    assert claim_and_send(relay) == []


def walk_claim(
    engine: sa.Engine, clock: ManualClock, walk: KeyWalk, limit: int
) -> list[ClaimedRow]:
    """One claim of `limit` through the driver, walking keys from `walk`."""
    with engine.begin() as conn:
        return driver_for(engine).claim_messages(
            conn,
            owner="relay-1",
            now=clock(),
            lease=30,
            limit=limit,
            budget=3,
            destinations=["default"],
            keys=walk,
        )


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize(("runs", "keys_taken"), [(10, FIRST_HEADS), (1, 20)])
def test_a_relays_first_claim_takes_few_long_keys_and_every_short_one(
    engine: sa.Engine, clock: ManualClock, runs: int, keys_taken: int
) -> None:
    # Twenty keys: of ten messages each, the first claim leaves most keys to other claims,
    # and is full all the same; of one message each, it takes them all.
    keys = [f"k{n:02d}" for n in range(20)]
    insert(engine, clock, *((f"{key}-{n}", key) for key in keys for n in range(runs)))
    taken = walk_claim(engine, clock, KeyWalk(), 40)
    assert len(taken) == min(40, 20 * runs)
    assert len({row.ordering_key for row in taken}) == keys_taken


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_claim_whose_few_keys_leave_room_walks_on_for_more_keys(
    engine: sa.Engine, clock: ManualClock
) -> None:
    # Six keys of three messages; the walk may take two keys, whose whole runs (six
    # messages) leave a claim of ten with room: later rounds take more keys, and each key
    # still has the start of its run, in order.
    assert KEY_ROUNDS >= 3
    keys = [f"k{n}" for n in range(6)]
    insert(engine, clock, *((f"{key}-{n}", key) for key in keys for n in range(3)))
    walk = KeyWalk(heads=2)
    taken = walk_claim(engine, clock, walk, 10)
    claimed = sorted(row.reply_id for row in taken)
    assert claimed == [*(f"{key}-{n}" for key in keys[:3] for n in range(3)), "k3-0"]
    # The bound moves on the first round alone: its two keys' runs left room, so it doubles.
    assert walk.heads == 4
    assert walk.cursors == {"default": "k3"}
