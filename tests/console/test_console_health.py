"""The overview's judgement of each destination, and its lists of relays and workers."""

from __future__ import annotations

import pytest

from outbox.drivers.common.announcements import LAPSED_KEPT
from outbox.drivers.records import RelayRow, WorkerRow
from outbox_cli.console.health import (
    RECENT,
    STALE_AFTER,
    LastAnswer,
    destination_health,
    judge,
    merged_answers,
    relays_announced,
    workers_announced,
)
from relay.figures import DestinationFigures

NOW = 1_000_000.0
IDLE = DestinationFigures()
WAITING = DestinationFigures(backlog=3, oldest_age=2.0)


@pytest.mark.parametrize(
    ("figures", "dead", "answer", "relays", "expected"),
    [
        # The last answer failed and replies wait: failing, however old the failure.
        (WAITING, 0, LastAnswer(NOW - 6000, NOW - 4000, 503, "x"), 1, "failing"),
        # Failed last, nothing waits, but within the hour: failing still.
        (IDLE, 0, LastAnswer(None, NOW - 60, None, "refused"), 1, "failing"),
        # Failed last over an hour ago, nothing waits since: nothing to say it still fails.
        (IDLE, 0, LastAnswer(NOW - 5000, NOW - RECENT - 1, 500, "x"), 1, "healthy"),
        # A delivery at the very moment of the failure (one batch, both answers): not failing.
        (WAITING, 0, LastAnswer(NOW - 5, NOW - 5, 422, "x"), 1, "degraded"),
        # No live relay: unrouted, whatever else.
        (WAITING, 4, LastAnswer(), 0, "unrouted"),
        (IDLE, 0, LastAnswer(), 0, "unrouted"),
        (IDLE, 1, LastAnswer(NOW - 5), 1, "degraded"),
        (
            DestinationFigures(backlog=1, oldest_age=STALE_AFTER + 1),
            0,
            LastAnswer(NOW),
            1,
            "degraded",
        ),
        (DestinationFigures(backlog=1, oldest_age=STALE_AFTER), 0, LastAnswer(NOW), 1, "healthy"),
        (WAITING, 0, LastAnswer(NOW - 1), 2, "healthy"),
        (IDLE, 0, LastAnswer(), 1, "healthy"),
    ],
)
def test_each_state_follows_its_rule(
    figures: DestinationFigures, dead: int, answer: LastAnswer, relays: int, expected: str
) -> None:
    state, why = judge(figures, dead, answer, relays, NOW)
    assert state == expected, why
    assert why


def test_the_reasons_are_said_in_words() -> None:
    answer = LastAnswer(NOW - 30, NOW - 90, 500, "boom")
    stale = DestinationFigures(backlog=2, dead=9, oldest_age=900.0)
    assert judge(stale, 3, answer, 1, NOW) == (
        "degraded",
        "3 dead in the last hour; oldest undelivered waiting 15.0m; an attempt failed 1.5m ago",
    )
    failing = LastAnswer(None, NOW - 2, None, "connection refused")
    assert judge(WAITING, 0, failing, 1, NOW) == (
        "failing",
        "last attempt failed (no answer) 2.0s ago; no delivery accepted since its relays started",
    )


def relay_row(owner: str, destination: str, expires_at: float, **answers: object) -> RelayRow:
    row = RelayRow(owner, destination, expires_at, expires_at - 60, None, None, None, None)
    return row._replace(**answers)


def test_the_relays_answers_merge_to_the_latest_of_each_lapsed_ones_included() -> None:
    rows = [
        relay_row(
            "r-1", "a", NOW + 10, last_sent_at=NOW - 50, last_failed_at=NOW - 40, last_status=503
        ),
        relay_row(
            "r-2", "a", NOW + 10, last_sent_at=NOW - 20, last_failed_at=NOW - 45, last_status=500
        ),
        # A relay that stopped (restarted under another name, say) still says what it saw.
        relay_row("gone", "a", NOW - 1, last_failed_at=NOW - 10, last_status=502),
    ]
    assert merged_answers(rows) == {"a": LastAnswer(NOW - 20, NOW - 10, 502, None)}


def test_a_destination_down_stays_failing_across_its_relays_restart() -> None:
    before = relay_row("relay-old", "a", NOW - 5, last_sent_at=NOW - 900, last_failed_at=NOW - 8)
    after = relay_row("relay-new", "a", NOW + 30)  # started, nothing answered yet
    [row] = destination_health({"a": WAITING}, {}, [before, after], NOW)
    assert (row.state, row.relays) == ("failing", 1)


def test_destinations_come_from_messages_relays_and_recent_dead_worst_first() -> None:
    rows = [relay_row("r-1", "live", NOW + 10), relay_row("gone", "lapsed", NOW - 5)]
    # "ancient" has dead replies alone, none of the last hour, and no relay: not listed.
    figures = {"waiting": WAITING, "live": IDLE, "ancient": DestinationFigures(dead=5)}
    health = destination_health(figures, {"old-dead": 1}, rows, NOW)
    assert [(row.name, row.state, row.relays) for row in health] == [
        ("lapsed", "unrouted", 0),
        ("old-dead", "unrouted", 0),
        ("waiting", "unrouted", 0),
        ("live", "healthy", 1),
    ]


def test_relays_and_workers_are_listed_live_first_with_their_last_heartbeat() -> None:
    rows = [
        relay_row("r-b", "x", NOW + 10)._replace(announced_at=NOW - 3),
        relay_row("r-b", "a", NOW + 10)._replace(announced_at=NOW - 3),
        relay_row("r-a", "x", NOW - 120)._replace(announced_at=None),
    ]
    relays = relays_announced(rows, NOW)
    assert [(r.owner, r.what, r.heard_at, r.live, r.lapsed_age) for r in relays] == [
        ("r-b", "a, x", NOW - 3, True, None),
        ("r-a", "x", None, False, 120.0),
    ]
    workers = workers_announced(
        [
            WorkerRow("w-2", "app.h", 4, NOW - 100, NOW - 2, NOW + 30),
            WorkerRow("w-1", "app.h", 1, NOW - 900, NOW - 800, NOW - 700),
        ],
        NOW,
    )
    assert [(w.owner, w.what, w.live, w.lapsed_age) for w in workers] == [
        ("w-2", "app.h (4 slots)", True, None),
        ("w-1", "app.h (1 slots)", False, 700.0),
    ]


def test_announcements_lapsed_over_an_hour_ago_are_not_shown_though_not_yet_deleted() -> None:
    rows = [
        relay_row("r-old", "gone", NOW - LAPSED_KEPT - 1, last_failed_at=NOW - 5000),
        relay_row("r-recent", "stopped", NOW - 60),
    ]
    assert [row.name for row in destination_health({}, {}, rows, NOW)] == ["stopped"]
    assert [relay.owner for relay in relays_announced(rows, NOW)] == ["r-recent"]
    workers = [WorkerRow("w-old", "h", 1, 0.0, 0.0, NOW - LAPSED_KEPT - 1)]
    assert workers_announced(workers, NOW) == []
