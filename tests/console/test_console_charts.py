"""The overview's per-minute charts: counted from stored timestamps, over their window only."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.console_helpers import ConsoleClient
from support.operations_helpers import mark_sent

import outbox
from outbox.operations import Operations
from outbox.schema import backlog_samples, messages
from outbox.testing import ManualClock
from outbox_cli.console import charts
from outbox_cli.console import pages as page_module
from outbox_cli.console.pages import Pages


def totals(page: str, minutes: int) -> dict[str, int]:
    """The totals the chart of a window shows, per series."""
    chart = page.split(f'data-window="{minutes}"', 1)[1].split("</figure>", 1)[0]
    return {k: int(v) for k, v in re.findall(r'data-series="([^"]+)">(\d+)<', chart)}


def test_the_charts_count_each_minute_of_their_window(
    ops: Operations,
    engine: sa.Engine,
    clock: ManualClock,
    make_client: Callable[..., ConsoleClient],
) -> None:
    # The seed: four replies enqueued 3h, 2h, 1h (dead) and 3h ago (the task's); one task
    # finished 3h ago. Now, sent: one 30 s ago, one 59 minutes ago, one two days ago.
    now = clock()
    with engine.begin() as conn:
        for n in range(3):
            conn.execute(
                messages.insert().values(
                    reply_id=f"sent-{n}", destination="billing", body=b"{}",
                    content_hash="0" * 64, headers="{}", state="pending", attempts=1,
                    available_at=now, fence=1, created_at=now - 2 * 86400,
                )
            )  # fmt: skip
    mark_sent(engine, {"sent-0": now - 30, "sent-1": now - 59 * 60, "sent-2": now - 2 * 86400})
    page = make_client().get("/").text
    assert totals(page, 60) == {
        "replies enqueued": 0,
        "replies sent": 2,
        "replies dead": 0,  # died 1h ago and more: the minute an hour back is not drawn
        "tasks finished": 0,
    }
    assert totals(page, 1440) == {
        "replies enqueued": 4,  # sent-* were created two days ago
        "replies sent": 2,
        "replies dead": 3,
        "tasks finished": 1,
    }


def test_a_chart_draws_one_point_per_minute_scaled_to_its_busiest() -> None:
    now = 600.0 * 60 + 10  # ten seconds into minute 600
    counts = {"enqueued": {600: 4, 599: 2, 541: 1, 540: 9}, "sent": {}, "dead": {}, "finished": {}}
    hour, day = charts.charts(counts, now)
    enqueued = hour.lines[0]
    points = [tuple(map(float, p.split(","))) for p in enqueued.points.split()]
    assert len(points) == 60
    assert (enqueued.total, enqueued.peak, hour.peak) == (7, 4, 4)  # minute 540 is outside
    assert points[0] == (0.0, charts.HEIGHT - 1 / 4 * charts.HEIGHT)  # minute 541
    assert points[-1] == (charts.WIDTH, 0.0)  # minute 600, the busiest: the top
    assert points[-2][1] == charts.HEIGHT / 2
    assert (day.lines[0].total, day.peak) == (16, 9)
    assert all(line.points.count(",") == 1440 for line in day.lines)


def test_the_day_is_read_in_one_query_per_series_on_the_database_clock(ops: Operations) -> None:
    now = charts.database_now(ops)
    counts = charts.minute_counts(ops, now, charts.LONGEST)
    assert set(counts) == {series for series, _, _ in charts.SERIES}
    assert sum(counts["dead"].values()) == 3


def test_settled_minutes_are_kept_and_only_the_recent_ones_read_again(
    ops: Operations, engine: sa.Engine, clock: ManualClock
) -> None:
    cache = charts.SettledCounts()
    now = charts.database_now(ops)
    first = cache.counts(ops, now, charts.LONGEST)
    assert first == charts.minute_counts(ops, now, charts.LONGEST)
    # Rows land in a settled minute (an hour back) and in the current one; the dead
    # series is read whole each time, so its settled minute changes too.
    with engine.begin() as conn:
        for reply_id, created, state in (
            ("old", now - 3600, "pending"),
            ("new", now, "pending"),
            ("died", now - 3600, "dead"),
        ):
            conn.execute(
                messages.insert().values(
                    reply_id=reply_id, destination="billing", body=b"{}",
                    content_hash="0" * 64, headers="{}", state=state, attempts=1,
                    available_at=created, fence=1, created_at=created,
                )
            )  # fmt: skip
    again = cache.counts(ops, now, charts.LONGEST)
    assert sum(again["enqueued"].values()) == sum(first["enqueued"].values()) + 1  # "new" only
    assert sum(again["dead"].values()) == sum(first["dead"].values()) + 1
    # An hour on, every minute is read again: "old" and "died" show as enqueued.
    later = now + charts.REREAD_AFTER * 60
    reread = cache.counts(ops, later, charts.LONGEST)
    assert reread == charts.minute_counts(ops, later, charts.LONGEST)
    assert sum(reread["enqueued"].values()) == sum(first["enqueued"].values()) + 3


def test_warming_reads_the_day_once_before_the_first_overview(
    ops: Operations, engine: sa.Engine
) -> None:
    pages = Pages(ops, None, read_only=False, token=False)
    pages.warm()
    compiled = {template.name for template in pages.templates.env.cache.values()}  # type: ignore[union-attr]
    assert compiled == set(pages.templates.env.list_templates())
    # The warm-up read the day: a row landing in a settled minute after it is not read
    # again by the overview, which only reads the recent minutes (a full read sees it).
    now = charts.database_now(ops)
    with engine.begin() as conn:
        for reply_id, created in (("settled", now - 3600), ("current", now)):
            conn.execute(
                messages.insert().values(
                    reply_id=reply_id, destination="billing", body=b"{}",
                    content_hash="0" * 64, headers="{}", state="pending", attempts=1,
                    available_at=created, fence=1, created_at=created,
                )
            )  # fmt: skip
    shown = pages.charted(None).counts(ops, now, charts.LONGEST)
    everything = charts.minute_counts(ops, now, charts.LONGEST)
    assert sum(shown["enqueued"].values()) == sum(everything["enqueued"].values()) - 1


def test_each_chart_has_a_utc_time_axis_and_its_values_on_hover() -> None:
    now = 600.0 * 60 + 10  # minute 600 of the epoch: 10:00 UTC
    counts = {"enqueued": {600: 4, 599: 2}, "sent": {595: 1}, "dead": {}, "finished": {}}
    hour, day = charts.charts(counts, now)
    # The hour is minutes 541 to 600 (09:01 to 10:00): a mark at each whole ten minutes.
    assert [tick.label for tick in hour.ticks] == [
        "09:10",
        "09:20",
        "09:30",
        "09:40",
        "09:50",
        "10:00",
    ]
    assert hour.ticks[-1].x == charts.WIDTH
    assert len(hour.spans) == 60
    assert hour.spans[-1].title == (
        "10:00 UTC: replies enqueued 4, replies sent 0, replies dead 0, tasks finished 0"
    )
    assert hour.spans[-6].title.startswith("09:55 UTC: replies enqueued 0, replies sent 1,")
    # The day: a mark every three hours, and spans of ten minutes, each their sum.
    assert [tick.label for tick in day.ticks][:3] == ["12:00", "15:00", "18:00"]
    assert len(day.spans) == 144
    assert day.spans[-1].title == (
        "09:51-10:01 UTC: replies enqueued 6, replies sent 1, replies dead 0, tasks finished 0"
    )
    assert day.spans[-1].x + day.spans[-1].width == pytest.approx(charts.WIDTH)


def test_the_overview_draws_the_axes_and_the_hover_titles(
    make_client: Callable[..., ConsoleClient],
) -> None:
    page = make_client().get("/").text
    hour = page.split('data-window="60"', 1)[1].split("</figure>", 1)[0]
    assert len(re.findall(r'<text class="tick"[^>]*>\d\d:\d\d</text>', hour)) == 6
    titles = re.findall(r'<rect class="span"[^>]*><title>([^<]+)</title>', hour)
    assert len(titles) == 60
    assert all(re.fullmatch(r"\d\d:\d\d UTC: replies enqueued \d+, .*", t) for t in titles)


def test_a_destinations_charts_count_its_replies_and_draw_no_tasks(
    ops: Operations, engine: sa.Engine, make_client: Callable[..., ConsoleClient]
) -> None:
    # A pending reply puts billing in the health rows, which name what may be charted.
    with Session(engine) as session, session.begin():
        outbox.publish(session, "billing", "b-waiting", {"n": 1})
    now = charts.database_now(ops)
    every = charts.minute_counts(ops, now, charts.LONGEST)
    billing = charts.SettledCounts("billing").counts(ops, now, charts.LONGEST)
    assert set(billing) == {"enqueued", "sent", "dead"}  # tasks have no destination
    assert sum(billing["dead"].values()) == 2 < sum(every["dead"].values())
    assert billing == charts.minute_counts(ops, now, charts.LONGEST, "billing")
    [hour, _] = charts.charts(billing, now)
    assert [line.label for line in hour.lines] == [
        "replies enqueued",
        "replies sent",
        "replies dead",
    ]
    page = make_client().get("/?chart=billing&refresh=off").text
    assert "Per minute: replies to billing" in page
    assert '<option value="billing" selected>' in page
    assert "tasks finished" not in page.split("Per minute", 1)[1]
    assert 'href="/?chart=billing" id="refresh-toggle"' in page
    # A name the health rows do not give charts every destination, and says so: each
    # destination charted costs a day's read, which a made-up name must not buy.
    made_up = make_client().get("/?chart=nowhere&refresh=off").text
    assert "No destination nowhere in the health rows" in made_up
    assert "tasks finished" in made_up.split("Per minute", 1)[1]
    assert '<option value="nowhere"' not in made_up


def test_the_console_keeps_the_counts_of_its_recent_charts_only(ops: Operations) -> None:
    pages = Pages(ops, None, read_only=False, token=False)
    every = pages.charted(None)
    kept = pages.charted("billing")
    assert pages.charted("billing") is kept
    for n in range(page_module.CHARTED_KEPT):
        pages.charted(f"d-{n}")
    assert len(pages.destination_counts) == page_module.CHARTED_KEPT
    assert pages.charted("billing") is not kept  # pushed out by the newer ones
    assert pages.charted(None) is every  # every destination's counts are never pushed out


def oldest_chart(page: str, minutes: int) -> str:
    """The oldest-undelivered chart of a window, as the overview draws it."""
    marker = f'data-window="{minutes}" data-chart="oldest"'
    return page.split(marker, 1)[1].split("</figure>", 1)[0]


def test_the_oldest_undelivered_age_is_charted_from_the_relays_samples_with_gaps(
    ops: Operations, clock: ManualClock, make_client: Callable[..., ConsoleClient]
) -> None:
    # The seed's dead replies are not undelivered; a pending one to billing, created now.
    with Session(ops.engine) as session, session.begin():
        outbox.publish(session, "billing", "waiting", {"n": 1}, clock=clock)
    with ops.engine.begin() as conn:
        for step in (60, 60, 120):  # the minute before the last, no relay sampled
            clock.advance(step)
            rows = ops.driver.backlog_sample(conn, clock(), ["billing"])
            ops.driver.record_backlog_sample(conn, rows)
    page = make_client().get("/").text
    hour = oldest_chart(page, 60)
    assert '<span data-sampled="60">3</span> of 60 minutes sampled' in hour
    # Two stretches: the gap is not drawn as a zero.
    [path] = re.findall(
        r'<path fill="none" stroke="[^"]+" stroke-width="1.5" [^>]*d="([^"]+)"', hour
    )
    assert path.count("M") == 2
    titles = re.findall(r"<title>([^<]+)</title>", hour)
    assert sum("not sampled (no relay ran)" in title for title in titles) == 57
    # Every destination's: the greatest, the seed's task reply waiting for hours.
    assert "highest: 3.1h" in hour
    billing = oldest_chart(make_client().get("/?chart=billing").text, 60)
    assert "highest: 4.0m" in billing
    billed = re.findall(r"<title>([^<]+)</title>", billing)
    assert [t.split("UTC: ", 1)[1] for t in billed if "UTC: oldest" in t] == [
        "oldest undelivered 1.0m",
        "oldest undelivered 2.0m",
        "oldest undelivered 4.0m",
    ]


def test_no_sample_draws_no_line_and_says_why(
    make_client: Callable[..., ConsoleClient],
) -> None:
    day = oldest_chart(make_client().get("/").text, 1440)
    assert "<path" not in day
    assert '<span data-sampled="1440">0</span> of 1440 minutes sampled (no relay ran)' in day
    assert "highest: none" in day


def test_settled_minutes_of_the_age_samples_are_kept_and_only_recent_ones_read_again(
    ops: Operations, engine: sa.Engine, clock: ManualClock
) -> None:
    cache = charts.SettledCounts()
    now = charts.database_now(ops)
    minute = int(now // 60)

    def sample(at_minute: int, age: float) -> None:
        with engine.begin() as conn:
            conn.execute(
                backlog_samples.insert().values(
                    sampled_at=at_minute * 60.0, destination="billing", backlog=1, oldest_age=age
                )
            )

    sample(minute - 30, 5.0)
    assert cache.oldest(ops, now, charts.LONGEST) == {minute - 30: 5.0}
    # A sample written later into a settled minute is not read again within the hour;
    # one in the current minute is.
    sample(minute - 40, 7.0)
    sample(minute, 9.0)
    assert cache.oldest(ops, now, charts.LONGEST) == {minute - 30: 5.0, minute: 9.0}
    later = now + charts.REREAD_AFTER * 60
    assert cache.oldest(ops, later, charts.LONGEST) == {
        minute - 40: 7.0,
        minute - 30: 5.0,
        minute: 9.0,
    }


def test_a_wider_window_than_the_kept_one_reads_the_samples_again(
    ops: Operations, engine: sa.Engine
) -> None:
    cache = charts.SettledCounts()
    now = charts.database_now(ops)
    minute = int(now // 60)
    with engine.begin() as conn:
        conn.execute(
            backlog_samples.insert().values(
                sampled_at=(minute - 100) * 60.0, destination="billing", backlog=1, oldest_age=3.0
            )
        )
    assert cache.oldest(ops, now, 60) == {}
    assert cache.oldest(ops, now, charts.LONGEST) == {minute - 100: 3.0}
