"""The console's decisions beyond one requeue: resolve one dead reply, and requeue or
resolve every dead reply a filter chooses, counted first, then confirmed; each audited
under the operator the console knows."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.console_helpers import OPERATOR, TOKEN, ConsoleClient, hold_receipt, log_in
from support.operations_helpers import audit_rows

import outbox
from outbox.operations import Operations
from outbox.schema import messages
from outbox.testing import ManualClock
from outbox_cli.console import audit_page
from outbox_cli.console.actions import NO_REASON, NOT_CONFIRMED
from outbox_cli.console.confirmations import CONFIRM_SECONDS
from outbox_cli.console.forms import CSRF_COOKIE

Client = Callable[..., ConsoleClient]


def post(console: ConsoleClient, path: str, page: str, **fields: str) -> httpx.Response:
    """POST a form after loading the page it is on, as the browser would."""
    console.get(page)
    return console.post(path, data={"csrf_token": console.cookies[CSRF_COOKIE], **fields})


def resolve(console: ConsoleClient, reply_id: str, **fields: str) -> httpx.Response:
    """POST the resolve form of a reply's page."""
    return post(console, "/reply/resolve", f"/reply?id={reply_id}", reply_id=reply_id, **fields)


def count(console: ConsoleClient, action: str, reason: str, **filters: str) -> httpx.Response:
    """POST the dead list's bulk form: its first step, the count."""
    return post(
        console, "/dead/bulk", "/dead", action=action, reason=reason, step="count", **filters
    )


def confirm_form(page: str) -> dict[str, str]:
    """The fields of the confirmation form a count's page offers."""
    assert 'id="bulk-confirm"' in page, page
    form = page.split('id="bulk-confirm"', 1)[1].split("</form>", 1)[0]
    return dict(re.findall(r'name="([a-z_]+)" value="([^"]*)"', form))


def outcomes(page: str) -> dict[str, int]:
    """What a bulk decision's page says it did, per outcome."""
    found = re.findall(r'data-outcome="([^"]+)">[^<]*<strong>(\d+)<', page)
    return {outcome: int(number) for outcome, number in found}


def state(ops: Operations, reply_id: str) -> str:
    """A message's state."""
    message = ops.message(reply_id)
    assert message is not None
    return str(message["state"])


def test_one_dead_reply_is_resolved_and_audited_under_the_operator(
    ops: Operations, make_client: Client, engine: sa.Engine
) -> None:
    console = make_client(operator=OPERATOR)
    page = console.get("/reply?id=s-1").text
    assert 'id="resolve-form"' in page
    assert f"resolve as {OPERATOR}" in page
    done = resolve(console, "s-1", reason="shipped by hand", by="mallory")
    assert done.status_code == 303
    [audit] = audit_rows(engine)
    assert done.headers["location"] == f"/reply?id=s-1&resolved={audit['id']}"
    assert (audit["action"], audit["requested_by"], audit["reason"]) == (
        "resolve",
        OPERATOR,
        "shipped by hand",
    )
    assert state(ops, "s-1") == "resolved"
    shown = console.get(done.headers["location"]).text
    assert 'id="resolved"' in shown
    assert 'id="resolve-form"' not in shown  # no longer dead


@pytest.mark.parametrize(
    ("reply_id", "reason", "operator", "why", "status"),
    [
        ("s-1", "  ", OPERATOR, NO_REASON, 400),
        ("nothing", "why", OPERATOR, None, 404),
        ("s-1", "why", None, "no operator name for the audit", 403),
    ],
    ids=["no reason", "no such reply", "no operator"],
)
def test_a_resolve_is_refused_with_the_reason_and_changes_nothing(
    ops: Operations,
    make_client: Client,
    engine: sa.Engine,
    reply_id: str,
    reason: str,
    operator: str | None,
    why: str | None,
    status: int,
) -> None:
    console = make_client(operator=operator)
    console.get("/reply?id=s-1")
    refused = console.post(
        "/reply/resolve",
        data={"csrf_token": console.cookies[CSRF_COOKIE], "reply_id": reply_id, "reason": reason},
    )
    assert refused.status_code == status
    if why is not None:
        assert f"Not resolved: {why}" in refused.text
    assert audit_rows(engine) == []
    assert state(ops, "s-1") == "dead"


def test_a_reply_that_is_not_dead_is_not_resolved(
    ops: Operations, make_client: Client, engine: sa.Engine
) -> None:
    with engine.connect() as conn:
        pending = conn.execute(
            sa.select(messages.c.reply_id).where(messages.c.state == "pending")
        ).scalar_one()
    refused = resolve(make_client(operator=OPERATOR), pending, reason="why")
    assert refused.status_code == 409
    assert "Not resolved: message is pending, not dead" in refused.text
    assert audit_rows(engine) == []


def test_a_bulk_requeue_counts_first_then_requeues_what_the_lookup_allows(
    seeded: str, ops: Operations, engine: sa.Engine, relay_config: Path, make_client: Client
) -> None:
    hold_receipt(seeded, engine, "b-1")  # billing already holds b-1
    console = make_client(config=str(relay_config), operator=OPERATOR)
    listed = console.get("/dead?destination=billing").text
    assert 'id="bulk-form"' in listed
    counted = count(console, "requeue", "billing is back", destination="billing")
    assert counted.status_code == 200
    assert 'id="bulk-count"><strong>2</strong> dead replies match' in counted.text
    assert audit_rows(engine) == []  # a count changes nothing
    form = confirm_form(counted.text)
    assert (form["action"], form["count"], form["destination"]) == ("requeue", "2", "billing")
    done = console.post("/dead/bulk", data=form)
    assert done.status_code == 200
    assert outcomes(done.text) == {"refused": 1, "requeued": 1}
    assert re.search(
        r'data-reply-id="b-1">.*?the destination already holds this exact message', done.text
    )
    assert (state(ops, "b-1"), state(ops, "b-2"), state(ops, "s-1")) == ("dead", "pending", "dead")
    [audit] = audit_rows(engine)
    assert (audit["reply_id"], audit["requested_by"], audit["reason"]) == (
        "b-2",
        OPERATOR,
        "billing is back",
    )


def test_a_bulk_decision_covers_only_the_replies_it_counted(
    ops: Operations, make_client: Client, engine: sa.Engine, clock: ManualClock
) -> None:
    console = make_client(operator=OPERATOR)
    counted = count(console, "resolve", "obsolete", destination="billing")
    form = confirm_form(counted.text)
    # After the count, an older message dies to billing (the task's reply, written before
    # every dead one), and a newer one: the confirmation covers neither.
    with engine.begin() as conn:
        older = conn.execute(
            sa.select(messages.c.reply_id).where(messages.c.state == "pending")
        ).scalar_one()
        conn.execute(
            messages.update()
            .where(messages.c.reply_id == older)
            .values(state="dead", destination="billing")
        )
    with Session(engine) as session, session.begin():
        outbox.publish(session, "billing", "b-late", {"id": "late"}, clock=clock)
    with engine.begin() as conn:
        conn.execute(messages.update().where(messages.c.reply_id == "b-late").values(state="dead"))
    # The reason confirmed is the one the count showed, whatever the form says now.
    done = console.post("/dead/bulk", data={**form, "reason": "something else"})
    assert outcomes(done.text) == {"resolved": 2}
    assert [state(ops, r) for r in ("b-1", "b-2", older, "b-late")] == [
        "resolved",
        "resolved",
        "dead",
        "dead",
    ]
    assert {row["reason"] for row in audit_rows(engine)} == {"obsolete"}


@pytest.mark.parametrize(
    "change",
    [
        {},  # used twice: the second is refused
        {"count": "3"},
        {"action": "requeue"},
        {"destination": "shipping"},
        {"error": "gone"},
        {"confirm": "forged"},
    ],
    ids=["reused", "count", "action", "filter", "another-filter", "forged"],
)
def test_a_bulk_confirmation_confirms_only_its_count_once(
    ops: Operations, make_client: Client, engine: sa.Engine, change: dict[str, str]
) -> None:
    console = make_client(operator=OPERATOR)
    form = confirm_form(count(console, "resolve", "obsolete", destination="billing").text)
    if not change:
        assert console.post("/dead/bulk", data=form).status_code == 200
        before = audit_rows(engine)
    else:
        before = []
    refused = console.post("/dead/bulk", data={**form, **change})
    assert refused.status_code == 409
    assert NOT_CONFIRMED in refused.text
    assert audit_rows(engine) == before


def test_a_bulk_confirmation_is_the_counting_sessions_and_expires(
    ops: Operations, make_client: Client, engine: sa.Engine
) -> None:
    clock = ManualClock(0.0)
    first = make_client(token=TOKEN, clock=clock)
    log_in(first)
    form = confirm_form(count(first, "resolve", "obsolete", destination="billing").text)
    other = make_client(app=first.app)
    log_in(other, operator="ops-bob")
    stolen = {**form, "csrf_token": other.cookies[CSRF_COOKIE]}
    assert other.post("/dead/bulk", data=stolen).status_code == 409
    form = confirm_form(count(first, "resolve", "obsolete", destination="billing").text)
    clock.advance(CONFIRM_SECONDS)
    assert first.post("/dead/bulk", data=form).status_code == 409
    assert audit_rows(engine) == []


def test_a_bulk_count_needs_a_reason_a_good_filter_and_an_operator(
    make_client: Client, engine: sa.Engine
) -> None:
    console = make_client(operator=OPERATOR)
    no_reason = count(console, "resolve", " ", destination="billing")
    assert no_reason.status_code == 400
    assert NO_REASON in no_reason.text
    bad = count(console, "resolve", "why", status="abc")
    assert bad.status_code == 400
    none = count(console, "resolve", "why", destination="nowhere")
    assert 'id="bulk-none"' in none.text
    assert count(console, "destroy", "why").status_code == 400
    nameless = count(make_client(), "resolve", "why")
    assert nameless.status_code == 403
    assert "no operator name for the audit" in nameless.text
    assert audit_rows(engine) == []


def test_a_read_only_console_offers_and_takes_no_decision(
    make_client: Client, engine: sa.Engine
) -> None:
    console = make_client(read_only=True, operator=OPERATOR)
    assert 'id="bulk-form"' not in console.get("/dead").text
    assert 'id="resolve-form"' not in console.get("/reply?id=s-1").text
    assert count(console, "resolve", "why").status_code == 403
    assert resolve(console, "s-1", reason="why").status_code == 403
    assert audit_rows(engine) == []


def test_the_audit_page_lists_decisions_newest_first_by_operator_and_page(
    ops: Operations, make_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops.resolve("b-1", reason="paid by hand", by="ops-anna")
    ops.resolve("b-2", reason="<b>dup</b>", by="ops-bob")
    ops.resolve("s-1", reason="lost", by="ops-anna")
    console = make_client()
    page = console.get("/audit").text
    assert re.findall(r'<td class="reply id"><a href="/reply\?id=([^"]+)"', page) == [
        "s-1",
        "b-2",
        "b-1",
    ]
    assert "&lt;b&gt;dup&lt;/b&gt;" in page  # a reason is shown as text
    anna = console.get("/audit?by=ops-anna").text
    assert re.findall(r'class="by"><a href="/audit\?by=([^"]+)"', anna) == ["ops-anna"] * 2
    monkeypatch.setattr(audit_page, "PAGE_SIZE", 1)
    first = console.get("/audit?by=ops-anna").text
    older = re.search(r'href="/audit\?([^"]+)" id="older-page"', first)
    assert older is not None
    second = console.get(f"/audit?{older[1].replace('&amp;', '&')}").text
    assert re.findall(r'<td class="reply id"><a href="/reply\?id=([^"]+)"', second) == ["b-1"]
    bad = console.get("/audit?before=abc")
    assert bad.status_code == 400
    assert "before: not a decision id" in bad.text


def test_a_new_count_replaces_the_sessions_last_bulk_confirmation(
    make_client: Client, engine: sa.Engine
) -> None:
    console = make_client(operator=OPERATOR)
    first = confirm_form(count(console, "resolve", "obsolete", destination="billing").text)
    second = confirm_form(count(console, "resolve", "obsolete", destination="shipping").text)
    assert console.post("/dead/bulk", data=second).status_code == 200
    assert console.post("/dead/bulk", data=first).status_code == 409  # replaced
    assert [row["reply_id"] for row in audit_rows(engine)] == ["s-1"]
