"""`outbox console`'s pages over a seeded database: overview, dead list, reply, task, search,
and the requeue, which is `outbox dead requeue`'s own."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from support.console_helpers import (
    OPERATOR,
    TOKEN,
    ConsoleClient,
    confirmation_of,
    csrf_of,
    hold_receipt,
    log_in,
)
from support.operations_helpers import audit_rows

from outbox.drivers.records import LastAnswers
from outbox.operations import Operations
from outbox.schema import messages
from outbox.testing import ManualClock
from outbox_cli.console import pages, reads
from outbox_cli.console.confirmations import CONFIRM_SECONDS
from outbox_cli.console.forms import CSRF_COOKIE
from outbox_cli.requeue import DestinationLookups

Client = Callable[..., ConsoleClient]


def cell(page: str, state: str, table: str) -> int:
    """The count a table of the overview shows for `state`."""
    section = page.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    found = re.search(rf'data-state="{state}">(\d+)<', section)
    assert found is not None, f"no {state} in {table}"
    return int(found[1])


def listed(page: str) -> list[str]:
    """The reply_ids a dead list page shows, in order."""
    return re.findall(r'<tr data-reply-id="([^"]+)">', page)


def test_the_overview_shows_the_counts_of_outbox_status(
    ops: Operations, make_client: Client
) -> None:
    answered = make_client().get("/")
    page = answered.text
    status = ops.status()
    assert (cell(page, "pending", "task-counts"), cell(page, "done", "task-counts")) == (2, 1)
    assert cell(page, "dead", "reply-counts") == status["messages"]["dead"] == 3
    assert cell(page, "pending", "reply-counts") == status["messages"]["pending"] == 1
    assert answered.headers["refresh"] == str(pages.REFRESH_SECONDS)


def health_rows(page: str) -> dict[str, tuple[str, str]]:
    """The overview's health table: each destination's (state, row's HTML)."""
    section = page.split('id="health"', 1)[1].split("</table>", 1)[0]
    found = re.findall(
        r'<tr data-destination="([^"]+)" data-state="([^"]+)">(.*?)</tr>', section, re.S
    )
    return {name: (state, row) for name, state, row in found}


def test_the_overview_counts_backlog_and_dead_per_destination_unrouted_included(
    make_client: Client,
) -> None:
    page = make_client().get("/").text
    rows = health_rows(page)
    # billing's dead are over an hour old and no relay delivers it: the dead list's, not a
    # health row's; shipping's died within the hour.
    assert set(rows) == {"default", "shipping"}
    assert re.search(r'class="dead"><a href="/dead\?destination=shipping">1<', rows["shipping"][1])
    assert 'class="backlog">1<' in rows["default"][1]  # the done task's reply, waiting
    # No relay announced any: each is unrouted, said in words as well as by its colour.
    assert {state for state, _ in rows.values()} == {"unrouted"}
    assert '<span class="state state-unrouted">unrouted</span>' in rows["default"][1]
    assert "no live relay delivers it; 1 waiting" in rows["default"][1]


def test_the_overview_judges_each_destination_from_the_live_relays_last_answers(
    ops: Operations, make_client: Client, clock: ManualClock
) -> None:
    now = clock()
    failing = LastAnswers(
        sent_age=600.0,
        failed_age=5.0,
        status=503,
        error="https://hooks.example/in?token=abc123 down",
    )
    recovered = LastAnswers(sent_age=1.0, failed_age=120.0, status=500, error="boom")
    with ops.engine.begin() as conn:
        ops.driver.announce(
            conn,
            owner="relay-a",
            destinations=["default", "billing", "quiet"],
            lease=60,
            now=now,
            answers={"default": failing, "billing": recovered},
        )
        ops.driver.announce(conn, owner="relay-gone", destinations=["x"], lease=10, now=now - 100)
        ops.driver.announce_worker(
            conn, owner="worker-1", handler="app.handle", concurrency=4, lease=30, now=now - 5
        )
    page = make_client().get("/").text
    rows = health_rows(page)
    # Worst first: the failing one, the unrouted ones, the degraded, the healthy.
    assert [(name, state) for name, (state, _) in rows.items()] == [
        ("default", "failing"),
        ("shipping", "unrouted"),
        ("x", "unrouted"),  # its one relay lapsed
        ("billing", "degraded"),
        ("quiet", "healthy"),
    ]
    assert "last attempt failed (status 503) 5.0s ago" in rows["default"][1]
    assert "last delivery accepted 10.0m ago" in rows["default"][1]
    assert "abc123" not in page  # the stored error is redacted before it is shown
    # billing delivers again, but an attempt failed within the hour; its dead are older.
    assert "an attempt failed 2.0m ago" in rows["billing"][1]
    assert "dead in the last hour" not in rows["billing"][1]
    assert 'class="dead-hour">1<' in rows["shipping"][1]  # s-1's last attempt, due 1 h ago
    assert "no delivery accepted since its relays started" in rows["quiet"][1]
    relays = page.split('id="relays"', 1)[1].split("</table>", 1)[0]
    assert re.search(r'data-owner="relay-a">.*?live', relays, re.S)
    assert re.search(r'data-owner="relay-gone">.*?lapsed 1\.5m ago', relays, re.S)
    workers = page.split('id="workers"', 1)[1].split("</table>", 1)[0]
    assert re.search(
        r'data-owner="worker-1">.*?app\.handle \(4 slots\).*?5\.0s ago.*?live', workers, re.S
    )


def test_the_overview_says_as_of_when_and_its_auto_refresh_can_be_paused(
    make_client: Client, clock: ManualClock
) -> None:
    console = make_client()
    answered = console.get("/")
    page = answered.text
    assert f'as of <time datetime="{pages.iso(clock())}">' in page
    assert answered.headers["refresh"] == "30"
    assert 'href="/?refresh=off"' in page
    paused_page = console.get("/?refresh=off")
    paused = paused_page.text
    assert "refresh" not in paused_page.headers
    assert "Auto-refresh paused" in paused
    assert 'href="/" id="refresh-toggle"' in paused


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", ["b-1", "b-2", "s-1"]),
        ("destination=billing", ["b-1", "b-2"]),
        ("status=409", ["b-2"]),
        ("error=GONE", ["b-1"]),
        ("error=%3Cb%3E", ["s-1"]),
        ("since=90m", ["s-1"]),  # created within the last 90 minutes
        ("until=2h", ["b-1", "b-2"]),
        ("destination=billing&error=conflict", ["b-2"]),
        ("destination=nowhere", []),
    ],
)
def test_the_dead_list_filters_as_dead_list_does(
    query: str, expected: list[str], ops: Operations, make_client: Client
) -> None:
    page = make_client().get(f"/dead?{query}")
    assert page.status_code == 200
    assert listed(page.text) == expected
    assert ('id="no-dead"' in page.text) is (not expected)


def test_a_bad_filter_is_said_on_the_page(make_client: Client) -> None:
    page = make_client().get("/dead?since=soon")
    assert page.status_code == 400
    assert "invalid duration" in page.text


def test_the_dead_list_pages(make_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages, "PAGE_SIZE", 2)
    console = make_client()
    first = console.get("/dead").text
    assert listed(first) == ["b-1", "b-2"]
    following = re.search(r'href="/dead\?([^"]+)" id="next-page"', first)
    assert following is not None
    second = console.get(f"/dead?{following[1].replace('&amp;', '&')}").text
    assert listed(second) == ["s-1"]
    assert 'id="next-page"' not in second
    assert 'id="first-page"' in second
    billing = console.get("/dead?destination=billing").text
    assert 'id="next-page"' not in billing  # exactly a page: no empty next one


def test_the_next_page_holds_when_the_last_row_shown_was_purged(
    ops: Operations, make_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pages, "PAGE_SIZE", 2)
    console = make_client()
    first = console.get("/dead").text
    assert listed(first) == ["b-1", "b-2"]
    following = re.search(r'href="/dead\?([^"]+)" id="next-page"', first)
    assert following is not None
    with ops.engine.begin() as conn:
        conn.execute(messages.delete().where(messages.c.reply_id == "b-2"))
    second = console.get(f"/dead?{following[1].replace('&amp;', '&')}")
    assert second.status_code == 200
    assert listed(second.text) == ["s-1"]


def test_a_page_start_that_is_not_a_row_id_is_said_on_the_page(make_client: Client) -> None:
    page = make_client().get("/dead?after=b-1")
    assert page.status_code == 400
    assert "after" in page.text


def test_the_reply_page_shows_the_body_escaped_and_the_delivery_record(
    make_client: Client,
) -> None:
    page = make_client(operator=OPERATOR).get("/reply?id=s-1").text
    assert "<script>" not in page
    assert "&lt;script&gt;document.title=&#39;ran&#39;&lt;/script&gt;" in page
    assert "a &amp; b" in page
    assert 'id="state">dead<' in page
    assert 'id="attempts">3<' in page
    assert "outcome unknown: &lt;b&gt;lease&lt;/b&gt; expired" in page
    assert 'id="requeue-form"' in page


def test_a_long_utf8_body_cut_inside_a_character_is_shown_as_text(
    ops: Operations, make_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "BODY_SHOWN", 8)
    # 3-byte characters: 8 bytes end inside the third one.
    with ops.engine.begin() as conn:
        conn.execute(
            messages.update().where(messages.c.reply_id == "b-1").values(body="€€€€".encode())
        )
    page = make_client().get("/reply?id=b-1").text
    assert "Not UTF-8 text" not in page
    assert re.search(r'<pre id="body">€€\n…</pre>', page)


def test_a_long_body_that_is_not_utf8_says_so(
    ops: Operations, make_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "BODY_SHOWN", 8)
    with ops.engine.begin() as conn:
        conn.execute(
            messages.update().where(messages.c.reply_id == "b-1").values(body=b"ab\xff" * 5)
        )
    assert "Not UTF-8 text" in make_client().get("/reply?id=b-1").text


def test_the_reply_page_never_shows_the_headers(ops: Operations, make_client: Client) -> None:
    with ops.engine.begin() as conn:
        conn.execute(
            messages.update()
            .where(messages.c.reply_id == "b-1")
            .values(headers='{"webhook-signature": "v1,c2lnbmF0dXJl"}')
        )
    assert "c2lnbmF0dXJl" not in make_client().get("/reply?id=b-1").text


def test_the_task_page_shows_the_task_and_links_its_reply(
    ops: Operations, make_client: Client, engine: sa.Engine
) -> None:
    with engine.connect() as conn:
        task_id, reply_id = conn.execute(
            sa.select(messages.c.task_id, messages.c.reply_id).where(
                messages.c.task_id.is_not(None)
            )
        ).one()
    console = make_client()
    page = console.get(f"/task?id={task_id}").text
    assert 'id="state">done<' in page
    assert 'id="fence">1<' in page
    assert '"ok": true' in page.replace("&#34;", '"')
    assert f'id="reply-link">{reply_id}<' in page
    reply = console.get(f"/reply?id={reply_id}").text
    assert f'id="task-link">{task_id}<' in reply
    assert 'id="requeue-form"' not in reply  # pending, not dead


def test_search_finds_a_reply_or_a_task(make_client: Client, engine: sa.Engine) -> None:
    with engine.connect() as conn:
        task_id = conn.execute(
            sa.select(messages.c.task_id).where(messages.c.task_id.is_not(None))
        ).scalar_one()
    console = make_client()
    assert console.get("/search?q=b-2").headers["location"] == "/reply?id=b-2"
    assert console.get(f"/search?q={task_id}").headers["location"] == f"/task?id={task_id}"
    missing = console.get("/search?q=%3Ci%3Enothing")
    assert missing.status_code == 404
    assert "&lt;i&gt;nothing" in missing.text
    assert console.get("/reply?id=nothing").status_code == 404
    assert console.get("/task?id=nothing").status_code == 404


def requeue(console: ConsoleClient, reply_id: str, **fields: str) -> httpx.Response:
    """POST the requeue form of a reply's page, as the browser would."""
    console.get(f"/reply?id={reply_id}")
    csrf = console.cookies[CSRF_COOKIE]
    return console.post("/reply/requeue", data={"csrf_token": csrf, "reply_id": reply_id, **fields})


def force_form(page: str) -> dict[str, str]:
    """The fields of the force form a refusal's page offers."""
    return dict(re.findall(r'name="([a-z_]+)" value="([^"]*)"', page.split('id="force-form"')[1]))


def test_without_a_receipt_lookup_a_requeue_is_refused_then_forced(
    ops: Operations, make_client: Client, engine: sa.Engine, no_relay_config: None
) -> None:
    console = make_client(operator=OPERATOR)
    # A `by` field, which the form once had, names no one: the console's operator does.
    refused = requeue(console, "b-1", reason="receiver was down", by="mallory")
    assert refused.status_code == 409
    text = refused.text
    assert "nothing could be asked whether the destination holds it" in text
    assert 'id="receipt">not checked<' in text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    assert audit_rows(engine) == []
    # The second, explicit step carries the confirmation the refusal issued, and force.
    form = force_form(text)
    assert form == {
        "csrf_token": csrf_of(text),
        "reply_id": "b-1",
        "confirm": confirmation_of(text),
        "force": "yes",
    }
    assert f"as <strong>{OPERATOR}</strong>" in text.split('id="force-form"')[1]
    done = console.post("/reply/requeue", data={**form, "by": "mallory", "reason": "other"})
    assert done.status_code == 303
    [audit] = audit_rows(engine)
    # The reason confirmed is the refusal's, whatever the second form says.
    assert (audit["requested_by"], audit["reason"], audit["forced"]) == (
        OPERATOR,
        "receiver was down",
        True,
    )
    assert (audit["receipt"], audit["previous_status"]) == ("not checked", 410)
    assert done.headers["location"] == f"/reply?id=b-1&requeued={audit['id']}"
    page = console.get(done.headers["location"]).text
    assert 'id="state">pending<' in page
    assert f"audit #{audit['id']}" in page
    assert f'class="by">{OPERATOR}<' in page
    assert 'id="requeue-form"' not in page
    assert 'id="reply-counts"' in console.get("/").text
    assert cell(console.get("/").text, "dead", "reply-counts") == 2


@pytest.mark.parametrize("confirm", [None, "", "made-up-confirmation-of-some-length"])
def test_force_without_the_refusals_confirmation_is_refused(
    confirm: str | None,
    ops: Operations,
    engine: sa.Engine,
    make_client: Client,
    no_relay_config: None,
) -> None:
    # The two steps were only the page's: a first POST with force=yes requeued at once.
    fields = {"reason": "down", "force": "yes"}
    if confirm is not None:
        fields["confirm"] = confirm
    answer = requeue(make_client(operator=OPERATOR), "b-1", **fields)
    assert answer.status_code == 409
    assert "force needs the confirmation this console gave when it refused" in answer.text
    assert 'id="force-form"' not in answer.text  # only a refusal of the lookup's issues one
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    assert audit_rows(engine) == []


def test_a_confirmation_holds_for_its_session_and_reply_once(
    ops: Operations, engine: sa.Engine, make_client: Client, no_relay_config: None
) -> None:
    anna = make_client(token=TOKEN)
    log_in(anna, "anna")
    lee = make_client(app=anna.app)
    log_in(lee, "lee")
    refused = requeue(anna, "b-1", reason="receiver was down")
    confirm = confirmation_of(refused.text)
    force = {"force": "yes", "confirm": confirm}
    # Another session, or another reply, is not confirmed by it.
    for console, reply_id in ((lee, "b-1"), (anna, "b-2")):
        answer = requeue(console, reply_id, **force)
        assert "force needs the confirmation" in answer.text
    assert [ops.message(r)["state"] for r in ("b-1", "b-2")] == ["dead", "dead"]  # type: ignore[index]
    assert audit_rows(engine) == []
    # Those tries did not use it up: its own session, for its own reply, once.
    assert requeue(anna, "b-1", **force).status_code == 303
    [audit] = audit_rows(engine)
    assert (audit["reply_id"], audit["requested_by"], audit["forced"]) == ("b-1", "anna", True)
    with engine.begin() as conn:  # dead again, as if sent and failed once more
        conn.execute(sa.update(messages).where(messages.c.reply_id == "b-1").values(state="dead"))
    again = requeue(anna, "b-1", **force)
    assert "force needs the confirmation" in again.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    assert len(audit_rows(engine)) == 1


def test_a_try_with_a_wrong_confirmation_uses_up_the_right_one(
    ops: Operations, make_client: Client, no_relay_config: None
) -> None:
    console = make_client(operator=OPERATOR)
    confirm = confirmation_of(requeue(console, "b-1", reason="down").text)
    assert "force needs" in requeue(console, "b-1", force="yes", confirm=confirm[::-1]).text
    assert "force needs" in requeue(console, "b-1", force="yes", confirm=confirm).text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]


def test_a_confirmation_expires(
    ops: Operations, make_client: Client, no_relay_config: None
) -> None:
    clock = ManualClock(1_000.0)
    console = make_client(operator=OPERATOR, clock=clock)
    confirm = confirmation_of(requeue(console, "b-1", reason="down").text)
    clock.advance(CONFIRM_SECONDS)
    expired = requeue(console, "b-1", force="yes", confirm=confirm)
    assert "force needs the confirmation" in expired.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    confirm = confirmation_of(requeue(console, "b-1", reason="down").text)
    clock.advance(CONFIRM_SECONDS - 1)
    assert requeue(console, "b-1", force="yes", confirm=confirm).status_code == 303


def test_a_confirmation_forces_only_the_answer_it_was_issued_for(
    ops: Operations,
    engine: sa.Engine,
    make_client: Client,
    monkeypatch: pytest.MonkeyPatch,
    no_relay_config: None,
) -> None:
    # Confirmed past a lookup that did not answer, then the destination says it holds the
    # message: forcing on would send a duplicate no one confirmed.
    answers = iter(["unknown", "received", "received"])
    monkeypatch.setattr(
        DestinationLookups, "__call__", lambda self, chosen: [next(answers) for _ in chosen]
    )
    console = make_client(operator=OPERATOR)
    first = requeue(console, "b-1", reason="lookup was down")
    assert 'id="receipt">unknown<' in first.text
    second = requeue(console, "b-1", force="yes", confirm=confirmation_of(first.text))
    assert second.status_code == 409
    assert "the destination already holds this exact message" in second.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    # That refusal issues a confirmation of its own answer.
    third = requeue(console, "b-1", force="yes", confirm=confirmation_of(second.text))
    assert third.status_code == 303
    [audit] = audit_rows(engine)
    assert (audit["receipt"], audit["reason"], audit["forced"]) == (
        "received",
        "lookup was down",
        True,
    )


def test_the_audit_names_the_session_whatever_the_form_says(
    ops: Operations, engine: sa.Engine, make_client: Client, no_relay_config: None
) -> None:
    console = make_client(token=TOKEN, operator="configured-but-unused")
    log_in(console, "  Anna Lindqvist  ")
    page = console.get("/reply?id=b-1").text
    assert 'id="operator">signed in as <strong>Anna Lindqvist</strong>' in page
    assert 'name="by"' not in page  # no free-text operator field
    refused = requeue(console, "b-1", reason="down", by="mallory")
    done = requeue(console, "b-1", force="yes", confirm=confirmation_of(refused.text), by="mallory")
    assert done.status_code == 303
    [audit] = audit_rows(engine)
    assert audit["requested_by"] == "Anna Lindqvist"


def test_a_bearer_token_alone_names_no_one_and_may_not_requeue(
    ops: Operations, engine: sa.Engine, make_client: Client, no_relay_config: None
) -> None:
    console = make_client(token=TOKEN)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    page = console.get("/reply?id=b-1", headers=bearer).text
    assert 'id="requeue-form"' not in page
    assert "log in through the form" in page
    form = {"csrf_token": console.cookies[CSRF_COOKIE], "reply_id": "b-1", "reason": "r"}
    answer = console.post("/reply/requeue", data={**form, "by": "ops"}, headers=bearer)
    assert answer.status_code == 409
    assert "the audit records the name given at login" in answer.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    assert audit_rows(engine) == []


def test_without_a_token_or_an_operator_a_requeue_is_refused(
    ops: Operations, engine: sa.Engine, make_client: Client, no_relay_config: None
) -> None:
    console = make_client()
    page = console.get("/reply?id=b-1").text
    assert 'id="requeue-form"' not in page
    assert 'id="nameless"' in page
    assert "--operator NAME" in page
    answer = requeue(console, "b-1", reason="down", by="ops")
    assert answer.status_code == 409
    assert "start the console with --operator NAME" in answer.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    assert audit_rows(engine) == []


def test_a_requeue_needs_a_reason(
    ops: Operations, make_client: Client, no_relay_config: None
) -> None:
    answer = requeue(make_client(operator=OPERATOR), "b-1", reason="  ")
    assert "a reason and the operator&#39;s name are both required" in answer.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]


def test_a_requeue_of_what_is_not_dead_is_refused(
    ops: Operations, make_client: Client, no_relay_config: None
) -> None:
    console = make_client(operator=OPERATOR)
    confirm = confirmation_of(requeue(console, "b-1", reason="r").text)
    assert requeue(console, "b-1", force="yes", confirm=confirm).status_code == 303
    again = requeue(console, "b-1", reason="r")
    assert again.status_code == 409
    assert "message is pending, not dead" in again.text
    assert 'id="force-form"' not in again.text


def test_a_requeue_asks_the_receipt_lookup_first_and_shows_what_it_said(
    seeded: str, ops: Operations, engine: sa.Engine, relay_config: Path, make_client: Client
) -> None:
    hold_receipt(seeded, engine, "b-1")  # the receiver holds it: only the ACK was lost
    console = make_client(config=str(relay_config), operator=OPERATOR)
    refused = requeue(console, "b-1", reason="check")
    assert "the destination already holds this exact message" in refused.text
    assert 'id="receipt">received<' in refused.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    # What the destination does not hold is requeued without force.
    assert requeue(console, "b-2", reason="down").status_code == 303
    [audit] = audit_rows(engine)
    assert (audit["reply_id"], audit["receipt"], audit["forced"]) == ("b-2", "not received", False)
