"""How many keys a PostgreSQL claim walks for: KeyWalk from claim to claim, and the rounds
within one claim (outbox.drivers.postgresql.claims.key_round_heads). No database."""

from __future__ import annotations

import pytest

from outbox.drivers.postgresql.claims import key_round_heads
from outbox.drivers.records import FIRST_HEADS, ClaimedRow, KeyWalk


def head(n: int, key: str | None = "k") -> ClaimedRow:
    """A claimed first message (its key `key`, suffixed by `n` for a keyed one)."""
    ordering_key = None if key is None else f"{key}{n}"
    return ClaimedRow(n, f"r-{n}", "orders", b"{}", "h", "{}", 1, 1, ordering_key, 30.0, 0)


def heads(count: int) -> list[ClaimedRow]:
    """`count` first messages of as many keys."""
    return [head(n) for n in range(count)]


def test_chains_that_fill_the_claim_halve_the_keys_it_took_not_the_walks_bound() -> None:
    # 100 keys in a claim of 1,000: halving the bound (1,000, then 500, 250, 125) took
    # every key again at each of four claims; half the keys taken is 50 at once.
    walk = KeyWalk(heads=None)
    walk.after_claim(1000, heads(100), 900)
    assert walk.heads == 50
    walk.after_claim(1000, heads(50), 950)
    assert walk.heads == 25


def test_a_bound_below_the_keys_found_is_halved_as_before() -> None:
    walk = KeyWalk(heads=8)
    walk.after_claim(1000, heads(8), 992)
    assert walk.heads == 4


def test_chains_that_leave_room_double_the_bound_and_unkeyed_claims_leave_it() -> None:
    walk = KeyWalk(heads=4)
    walk.after_claim(1000, heads(4), 400)
    assert walk.heads == 8
    walk.after_claim(1000, [head(n, None) for n in range(1000)], 0)
    assert walk.heads == 8


def test_a_walk_that_found_fewer_keys_than_its_bound_leaves_it() -> None:
    # The tail of a backlog of long keys: few keys left, their chains short. Doubled, the
    # bound let the next backlog's first claim take every key again.
    walk = KeyWalk(heads=6)
    walk.after_claim(1000, heads(2), 40)
    assert walk.heads == 6


def test_a_relays_first_walk_takes_few_keys() -> None:
    assert KeyWalk().heads == FIRST_HEADS
    assert FIRST_HEADS <= 10


@pytest.mark.parametrize(
    ("taken", "chained", "taking", "room", "expected"),
    [
        # Three keys of 170 took 510 of 1,000: the next round walks for three more.
        (3, 507, 3, 490, 3),
        # The walk found fewer keys than it walked for: no more are waiting.
        (2, 338, 3, 660, 0),
        # No room left, or no key taken: no next round.
        (3, 997, 3, 0, 0),
        (0, 0, 3, 1000, 0),
        # Runs longer than the room: one key more, never none.
        (1, 199, 1, 100, 1),
        # Short runs: as many keys as fill the room, at most the room.
        (4, 0, 4, 6, 6),
    ],
)
def test_a_next_round_walks_for_as_many_keys_as_the_runs_say_fill_the_room(
    taken: int, chained: int, taking: int, room: int, expected: int
) -> None:
    assert key_round_heads(heads(taken), chained, taking, room) == expected


def test_unkeyed_first_messages_do_not_count_as_keys_taken() -> None:
    # Two unkeyed messages and one key: the walk took one key of the two it walked for.
    taken = [head(0, None), head(1, None), head(2)]
    assert key_round_heads(taken, 5, 2, 100) == 0
