"""The one-statement settle stays fenced and exact run after run.

PostgreSQL switches a statement prepared five times to a generic plan; the settle
runs unprepared (UNPREPARED) with binary arrays, so many runs in a row must keep
settling exactly the rows whose (id, fence) match, with every column as given.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from support.relay_helpers import publish_many, rows

from outbox.drivers import driver_for
from outbox.drivers.postgresql.binary_arrays import dumping_numbers
from outbox.drivers.postgresql.settle import SETTLE_POSTGRESQL, settle_parameters
from outbox.drivers.records import FailedAttempt
from outbox.schema import failed_attempts
from relay.records import ClaimedRow, Message, Settlement

TURNS = 12  # past psycopg's prepare threshold and PostgreSQL's five custom plans


def claim_messages(conn: sa.Connection, **claim: Any) -> list[ClaimedRow]:
    """The claim of the connection's driver."""
    return driver_for(conn).claim_messages(conn, **claim)


def settle(conn: sa.Connection, owner: str, rows: list[Settlement], now: float | None) -> set[int]:
    """The settle of the connection's driver."""
    return driver_for(conn).settle(conn, owner, rows, now)


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
        ident, fence, lease = claimed.id, claimed.fence, claimed.lease_until
        outcome = (
            Settlement(ident, fence, "dead", 409, f"conflict {turn}", 0.0, 0, lease)
            if turn % 2
            else Settlement(ident, fence, "sent", 200, None, 0.0, 0, lease)
        )
        with engine.begin() as conn:
            # A stale fence and a foreign owner touch nothing.
            stale = Settlement(ident, fence - 1, "sent", 200, None, 0.0, 0, lease)
            assert settle(conn, "o", [stale], None) == set()
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
    from outbox.drivers.common.claims import CLAIMED

    assert [c.name for c in CLAIMED] + ["previous_attempts"] == list(ClaimedRow._fields)


def test_a_claimed_row_becomes_the_message_of_its_fields_with_or_without_headers() -> None:
    # Message.from_row takes a usual row's first fields as they are.
    assert Message._fields == ClaimedRow._fields[: len(Message._fields)]
    plain = ClaimedRow(7, "r-7", "d", b"{}", "h", "{}", 2, 3, None, 9.5, 1)
    keyed = plain._replace(body=memoryview(b"[]"), headers='{"a": "b"}', ordering_key="k")
    assert Message.from_row(plain) == Message(7, "r-7", "d", b"{}", "h", {}, 2, 3, None, 9.5)
    assert Message.from_row(keyed) == Message(7, "r-7", "d", b"[]", "h", {"a": "b"}, 2, 3, "k", 9.5)
    assert type(Message.from_row(keyed).body) is bytes


def test_settle_answers_exactly_the_rows_it_changed_among_many(engine: sa.Engine) -> None:
    publish_many(engine, [f"m-{n}" for n in range(3)])
    with engine.begin() as conn:
        claimed = claim_messages(
            conn, owner="o", now=None, lease=30, limit=3, budget=3, destinations=["default"]
        )
    stale = claimed[1]
    outcomes = [
        Settlement(c.id, c.fence - (c is stale), "sent", 200, None, 0.0, 0, c.lease_until)
        for c in claimed
    ]
    with engine.begin() as conn:
        assert settle(conn, "o", outcomes, None) == {claimed[0].id, claimed[2].id}
    states = {reply_id: row["state"] for reply_id, row in rows(engine).items()}
    assert states == {"m-0": "sent", "m-1": "sending", "m-2": "sent"}


IN_FLIGHT = 3000
"""Other relays' messages in flight while one turn of ten settles."""
HISTORY = 20_000
"""Delivered messages: what the table mostly holds."""


def scanned_rows(plan: dict[str, Any]) -> int:
    """Rows the plan's scans of outbox_messages read: returned plus filtered out."""
    read = 0
    if plan.get("Relation Name") == "outbox_messages":
        read += int(plan["Actual Rows"]) * int(plan.get("Actual Loops", 1))
        read += int(plan.get("Rows Removed by Filter", 0))
    return read + sum(scanned_rows(child) for child in plan.get("Plans", []))


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_settle_reads_its_own_turns_rows_not_every_message_in_flight(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_messages (reply_id, destination, body, content_hash, "
                "headers, state, attempts, fence, available_at, created_at) "
                "SELECT 'f-' || n, 'default', '\\x7b7d', 'h', '{}', CASE WHEN n <= :history "
                "THEN 'sent' ELSE 'pending' END, 0, 0, 0, n FROM generate_series(1, :n) n"
            ),
            {"history": HISTORY, "n": HISTORY + IN_FLIGHT + 10},
        )
    with engine.connect() as conn:
        # Statistics as a live table has them between drains: nothing in flight.
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            "ANALYZE outbox_messages"
        )
    claim = {"now": None, "lease": 30, "budget": 3, "destinations": ["default"]}
    with engine.begin() as conn:
        claim_messages(conn, owner="others", limit=IN_FLIGHT, **claim)
    with engine.begin() as conn:
        mine = claim_messages(conn, owner="o", limit=10, **claim)
    outcomes = [Settlement(c.id, c.fence, "sent", 200, None, 0.0, 0, c.lease_until) for c in mine]
    with engine.connect() as conn:
        dumping_numbers(conn)
        explained = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + SETTLE_POSTGRESQL,
            settle_parameters("o", outcomes, None),
        ).scalar_one()
        conn.rollback()
    plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]
    assert scanned_rows(plan) <= 3 * len(mine), json.dumps(plan, indent=1)


def test_a_settlement_without_its_lease_is_refused_not_left_sending(engine: sa.Engine) -> None:
    publish_many(engine, ["l-1"])
    with engine.begin() as conn:
        [claimed] = claim_messages(
            conn, owner="o", now=None, lease=30, limit=1, budget=3, destinations=["default"]
        )
    lost = Settlement(claimed.id, claimed.fence, "sent", 200, None, 0.0, 0, None)
    if engine.dialect.name == "postgresql":
        with pytest.raises(ValueError, match="without the lease"), engine.begin() as conn:
            settle(conn, "o", [lost], None)
    found = Settlement(claimed.id, claimed.fence, "sent", 200, None, 0.0, 0, claimed.lease_until)
    with engine.begin() as conn:
        assert settle(conn, "o", [found], None) == {claimed.id}


def test_a_turn_without_failed_attempts_runs_the_plain_settle(engine: sa.Engine) -> None:
    # The drain's turns deliver everything: their settle must not carry the recording
    # form's insert, however cheap an empty one is.
    publish_many(engine, ["p-1", "p-2"])
    sent: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def seen(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "UPDATE outbox_messages" in statement and "outbox_requeues" not in statement:
            sent.append(statement)

    with engine.begin() as conn:
        first, second = claim_messages(
            conn, owner="o", now=None, lease=30, limit=2, budget=3, destinations=["default"]
        )
    delivered = Settlement(first.id, first.fence, "sent", 200, None, 0.0, 0, first.lease_until)
    retried = Settlement(
        second.id, second.fence, "pending", 503, "busy", 0.0, 0, second.lease_until
    )
    with engine.begin() as conn:
        sent.clear()
        settle(conn, "o", [delivered], None)
        assert sent, "the settle ran no UPDATE"
        assert not any("outbox_failed_attempts" in s for s in sent), sent
        sent.clear()
        failure = FailedAttempt(second.id, second.attempts, "pending", 503, "busy")
        driver_for(conn).settle(conn, "o", [retried], None, [failure])
        # The recording form on PostgreSQL; a statement of its own elsewhere.
        recorded = conn.execute(sa.select(failed_attempts.c.message_id)).scalars().all()
        assert recorded == [second.id]
