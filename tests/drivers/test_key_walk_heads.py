"""How many keys a PostgreSQL claim walks for: KeyWalk from claim to claim. No database."""

from __future__ import annotations

from outbox.drivers.records import ClaimedRow, KeyWalk


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
    walk = KeyWalk()
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
