"""The one-statement settle stays fenced and exact run after run.

PostgreSQL switches a statement prepared five times to a generic plan; the settle
runs unprepared (UNPREPARED) with binary arrays, so many runs in a row must keep
settling exactly the rows whose (id, fence) match, with every column as given.
"""

from __future__ import annotations

import sqlalchemy as sa
from support.relay_helpers import publish_many, rows

from relay.records import Settlement
from relay.sql import claim_messages, settle

TURNS = 12  # past psycopg's prepare threshold and PostgreSQL's five custom plans


def test_settle_matches_id_and_fence_on_every_run(engine: sa.Engine) -> None:
    publish_many(engine, [f"s-{n}" for n in range(TURNS)])
    for turn in range(TURNS):
        with engine.begin() as conn:
            [claimed] = claim_messages(
                conn,
                owner="o",
                now=None,
                lease=30,
                limit=1,
                budget=3,
                destinations=["default"],
            )
        ident, fence = claimed.id, claimed.fence
        outcome = (
            Settlement(ident, fence, "dead", 409, f"conflict {turn}", 0.0, 0)
            if turn % 2
            else Settlement(ident, fence, "sent", 200, None, 0.0, 0)
        )
        with engine.begin() as conn:
            # A stale fence and a foreign owner touch nothing.
            assert (
                settle(conn, "o", [Settlement(ident, fence - 1, "sent", 200, None, 0.0, 0)], None)
                == set()
            )
            assert settle(conn, "other", [outcome], None) == set()
            assert settle(conn, "o", [outcome], None) == {ident}
    stored = rows(engine)
    for turn in range(TURNS):
        row = stored[f"s-{turn}"]
        if turn % 2:
            assert (row["state"], row["last_status"], row["last_error"]) == (
                "dead",
                409,
                f"conflict {turn}",
            )
            assert row["sent_at"] is None
        else:
            assert (row["state"], row["last_status"], row["last_error"]) == ("sent", 200, None)
            assert row["sent_at"] is not None
        assert row["lease_until"] is None


def test_claimed_rows_are_read_into_records_in_their_returning_order() -> None:
    from relay.records import ClaimedRow
    from relay.sql import CLAIMED

    assert [c.name for c in CLAIMED] + ["previous_attempts"] == list(ClaimedRow._fields)


def test_settle_answers_exactly_the_rows_it_changed_among_many(engine: sa.Engine) -> None:
    publish_many(engine, [f"m-{n}" for n in range(3)])
    with engine.begin() as conn:
        claimed = claim_messages(
            conn, owner="o", now=None, lease=30, limit=3, budget=3, destinations=["default"]
        )
    stale = claimed[1]
    outcomes = [
        Settlement(c.id, c.fence - (c is stale), "sent", 200, None, 0.0, 0) for c in claimed
    ]
    with engine.begin() as conn:
        assert settle(conn, "o", outcomes, None) == {claimed[0].id, claimed[2].id}
    states = {reply_id: row["state"] for reply_id, row in rows(engine).items()}
    assert states == {"m-0": "sent", "m-1": "sending", "m-2": "sent"}
