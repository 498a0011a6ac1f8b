"""The console's lists of replies by state (filters, both orders, keyset pages, bad queries
refused with a reason), and a reply's timeline."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.console_helpers import ConsoleClient

import outbox
from outbox.drivers.records import FailedAttempt, Settlement
from outbox.operations import Operations
from outbox.schema import messages
from outbox.testing import ManualClock
from outbox_cli.console import lists

Client = Callable[..., ConsoleClient]


def listed(page: str) -> list[str]:
    """The reply_ids a list's page shows, in order."""
    return re.findall(r'<tr data-reply-id="([^"]+)">', page)


def timeline(page: str) -> list[str]:
    """What each line of a reply's timeline says happened, in order."""
    return re.findall(r'<li data-what="([^"]+)">', page)


def test_the_dead_are_listed_oldest_first_or_newest_first_and_by_destination(
    make_client: Client,
) -> None:
    console = make_client()
    oldest = console.get("/replies?state=dead")
    assert oldest.status_code == 200
    assert listed(oldest.text) == ["b-1", "b-2", "s-1"]
    assert listed(console.get("/replies?state=dead&order=newest").text) == ["s-1", "b-2", "b-1"]
    assert listed(console.get("/replies?state=dead&destination=billing").text) == ["b-1", "b-2"]
    nothing = console.get("/replies?state=resolved")
    assert listed(nothing.text) == []
    assert 'id="no-replies"' in nothing.text


def test_pages_follow_each_other_to_the_end(
    make_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lists, "PAGE_SIZE", 2)
    console = make_client()
    first = console.get("/replies?state=dead&order=newest").text
    assert listed(first) == ["s-1", "b-2"]
    [more] = re.findall(r'href="/replies\?([^"]+)" id="next-page"', first)
    second = console.get(f"/replies?{more.replace('&amp;', '&')}").text
    assert listed(second) == ["b-1"]
    assert 'id="next-page"' not in second
    assert 'id="first-page"' in second


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("state=lost", "state must be one of pending, sending, sent, dead, resolved"),
        ("state=dead&order=random", "order must be oldest or newest"),
        ("state=dead&after=soon", "after: not a place in the list"),
        ("state=dead&after=nan,1", "after: not a place in the list"),
        ("state=dead&after=1,-2", "after: not a place in the list"),
    ],
)
def test_a_bad_query_is_refused_with_the_reason(make_client: Client, query: str, said: str) -> None:
    refused = make_client().get(f"/replies?{query}")
    assert refused.status_code == 400
    assert said in refused.text


def test_the_overview_links_each_count_to_its_list(make_client: Client) -> None:
    page = make_client().get("/").text
    for state in lists.REPLIES.states:
        assert f'<a href="/replies?state={state}">{state}</a>' in page
    assert '<a href="/replies">replies</a>' in page


def test_a_replys_timeline_tells_its_story_in_order(
    ops: Operations, make_client: Client, clock: ManualClock
) -> None:
    console = make_client()
    dead = console.get("/reply?id=b-1").text
    assert timeline(dead) == ["created", "now"]
    assert "now <strong>dead</strong>: 3 attempts, last status 410" in dead
    clock.advance(60)
    ops.requeue("b-1", reason="billing is back", by="anna", receipt="not received", forced=False)
    clock.advance(60)
    with ops.engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.reply_id == "b-1")
            .values(state="sent", sent_at=clock(), attempts=1, last_status=200)
        )
    sent = console.get("/reply?id=b-1").text
    assert timeline(sent) == ["created", "requeued", "sent"]
    assert "by anna (billing is back), after 3 attempts, last status 410: HTTP 410: gone" in sent
    assert "<strong>sent</strong> after 1 attempts" in sent


def test_tasks_are_listed_by_state_and_tenant(make_client: Client) -> None:
    console = make_client()
    pending = console.get("/tasks?state=pending")
    assert pending.status_code == 200
    shown = re.findall(r'<tr data-task-id="([^"]+)">', pending.text)
    assert len(shown) == 2  # of the seeded three, one is done
    [done] = re.findall(r'<tr data-task-id="([^"]+)">', console.get("/tasks?state=done").text)
    assert done not in shown
    assert console.get("/tasks?state=pending&tenant=nobody").text.count("data-task-id") == 0
    assert 'id="no-tasks"' in console.get("/tasks?state=failed").text
    refused = console.get("/tasks?state=dead")
    assert refused.status_code == 400
    assert "state must be one of pending, running, done" in refused.text
    assert console.get("/tasks?state=done&after=1.5,").status_code == 400
    overview = console.get("/").text
    assert '<a href="/tasks?state=hop_limit">hop_limit</a>' in overview


def test_a_resolved_replys_timeline_says_so_once(
    ops: Operations, make_client: Client, clock: ManualClock
) -> None:
    clock.advance(60)
    audit = ops.resolve("b-2", reason="settled by phone", by="anna")
    console = make_client()
    page = console.get("/reply?id=b-2").text
    # The banner of a decision just taken shows for that decision, of that kind, alone.
    assert 'id="resolved"' in console.get(f"/reply?id=b-2&resolved={audit['id']}").text
    assert 'id="requeued"' not in console.get(f"/reply?id=b-2&requeued={audit['id']}").text
    assert timeline(page) == ["created", "resolved"]
    assert "by anna (settled by phone), after 3 attempts, last status 409" in page


def test_a_replys_timeline_shows_each_failed_attempt_with_its_answer(
    ops: Operations, make_client: Client, clock: ManualClock
) -> None:
    with Session(ops.engine) as session, session.begin():
        outbox.publish(session, "billing", "f-1", {"id": "f-1"}, clock=clock)
    driver, failures = ops.driver, [(503, "HTTP 503: <i>busy</i>"), (None, "timed out")]
    for status, error in failures:
        clock.advance(10)
        with ops.engine.begin() as conn:
            [row] = driver.claim_messages(
                conn, owner="r", now=clock(), lease=30, limit=1, budget=5, destinations=["billing"]
            )
            failure = Settlement(
                row.id, row.fence, "pending", status, error, 0.0, 0, row.lease_until
            )
            answer = FailedAttempt(row.id, row.attempts, "pending", status, error)
            assert driver.settle(conn, "r", [failure], clock(), [answer]) == {row.id}
    clock.advance(10)
    with ops.engine.begin() as conn:
        driver.claim_messages(
            conn, owner="r", now=clock(), lease=30, limit=1, budget=5, destinations=["billing"]
        )
        assert driver.reap_expired_message_leases(conn, clock() + 30, 10) == 1
    page = make_client().get("/reply?id=f-1").text
    assert timeline(page) == ["created", "retry", "retry", "retry", "now"]
    # Escaped: an answer's text is the destination's.
    assert "attempt 1, status 503: HTTP 503: &lt;i&gt;busy&lt;/i&gt;" in page
    assert "attempt 2: timed out" in page
    assert "attempt 3: lease expired" in page
