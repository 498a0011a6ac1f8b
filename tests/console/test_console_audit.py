"""The console's audit page: decisions about dead replies (requeue, resolve) and about
tasks (cancel) in one list, newest first, each linked to what it decided about, paged by
each kind's own ids, of both kinds or one."""

from __future__ import annotations

import re
from collections.abc import Callable
from html import unescape
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from support.console_helpers import ConsoleClient

from outbox.operations import Operations
from outbox.schema import tasks
from outbox.testing import ManualClock
from outbox_cli.console import audit_page

Client = Callable[..., ConsoleClient]
ROW = re.compile(
    r'<tr data-kind="(reply|task)" data-audit-id="\d+">.*?'
    r'<td class="(?:reply|task) id"><a href="(/(?:reply|task)\?id=[^"]+)">([^<]*)</a>',
    re.DOTALL,
)
"""An audit row: its kind, the link to what it decided about, and the link's text."""


def listed(page: str) -> list[tuple[str, str, str]]:
    """The audit rows of a page, in order: (kind, link, what the link says)."""
    return [(kind, unescape(link), text) for kind, link, text in ROW.findall(page)]


def older_link(page: str) -> str | None:
    """The path of the page's link to older decisions, or None."""
    found = re.search(r'href="(/audit\?[^"]+)" id="older-page"', page)
    return None if found is None else unescape(found[1])


def pending_tasks(engine: sa.Engine) -> list[str]:
    """The seeded pending tasks, in task_id order."""
    with engine.connect() as conn:
        query = sa.select(tasks.c.task_id).where(tasks.c.state == "pending")
        return sorted(conn.execute(query).scalars())


def task_link(task_id: str) -> str:
    """The task page's path, as the audit links it."""
    return f"/task?id={quote(task_id)}"


def test_the_audit_lists_both_kinds_newest_first_each_linked_to_its_page(
    ops: Operations, make_client: Client, engine: sa.Engine, clock: ManualClock
) -> None:
    first, second = pending_tasks(engine)
    ops.resolve("b-1", reason="paid by hand", by="ops-anna")
    clock.advance(60)
    ops.cancel_task(first, reason="customer withdrew", by="ops-bob")
    clock.advance(60)
    ops.resolve("s-1", reason="shipped by hand", by="ops-anna")
    clock.advance(60)
    ops.cancel_task(second, reason="duplicate", by="ops-anna")
    page = make_client().get("/audit")
    assert page.status_code == 200
    assert listed(page.text) == [
        ("task", task_link(second), second),
        ("reply", "/reply?id=s-1", "s-1"),
        ("task", task_link(first), first),
        ("reply", "/reply?id=b-1", "b-1"),
    ]
    assert re.findall(r'<td class="action">(\w+)</td>', page.text) == [
        "cancel",
        "resolve",
        "cancel",
        "resolve",
    ]
    # A task's row says what is not kept for it; a reply's shows what its decision replaced.
    cancel, resolve = re.findall(r"<tr data-kind=.*?</tr>", page.text, re.DOTALL)[:2]
    assert '<td class="reason">duplicate</td><td></td><td></td>' in cancel
    assert '<td class="error">not kept</td>' in cancel
    assert '<td class="reason">shipped by hand</td><td>not checked</td><td>no</td>' in resolve
    assert '<td class="error">3, , outcome unknown: &lt;b&gt;lease&lt;/b&gt; expired</td>' in (
        resolve
    )
    assert '<td class="by"><a href="/audit?by=ops-bob">ops-bob</a></td>' in page.text


def test_the_audit_shows_reasons_and_names_as_text(
    ops: Operations, make_client: Client, engine: sa.Engine
) -> None:
    [task_id, _] = pending_tasks(engine)
    ops.cancel_task(task_id, reason="<script>alert(1)</script>", by='ops "<b>eve</b>"')
    ops.resolve("b-1", reason="<i>paid</i> & done", by="<em>ann</em>")
    page = make_client().get("/audit").text
    assert "<script>alert" not in page
    assert "<b>eve" not in page
    assert "<em>ann" not in page
    assert '<td class="reason">&lt;script&gt;alert(1)&lt;/script&gt;</td>' in page
    assert '<td class="reason">&lt;i&gt;paid&lt;/i&gt; &amp; done</td>' in page
    # The name shown as text, and passed on in its link as a query value.
    eve = "ops &#34;&lt;b&gt;eve&lt;/b&gt;&#34;"
    assert f'<a href="/audit?by=ops%20%22%3Cb%3Eeve%3C/b%3E%22">{eve}</a>' in page
    assert '<a href="/audit?by=%3Cem%3Eann%3C/em%3E">&lt;em&gt;ann&lt;/em&gt;</a>' in page


def test_the_audit_pages_across_the_kind_boundary_with_none_lost_or_repeated(
    ops: Operations,
    make_client: Client,
    engine: sa.Engine,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = pending_tasks(engine)
    ops.resolve("b-1", reason="why", by="ops-anna")
    clock.advance(60)
    ops.cancel_task(first, reason="why", by="ops-anna")
    clock.advance(60)
    ops.cancel_task(second, reason="why", by="ops-anna")
    clock.advance(60)
    ops.resolve("b-2", reason="why", by="ops-anna")
    clock.advance(60)
    ops.resolve("s-1", reason="why", by="ops-anna")
    monkeypatch.setattr(audit_page, "PAGE_SIZE", 2)
    console = make_client()
    pages: list[list[str]] = []
    path: str | None = "/audit"
    while path is not None:
        answer = console.get(path)
        assert answer.status_code == 200
        pages.append([text for _, _, text in listed(answer.text)])
        path = older_link(answer.text)
    assert pages == [["s-1", "b-2"], [second, first], ["b-1"]]


def test_a_decision_made_while_paging_waits_for_the_first_page(
    ops: Operations,
    make_client: Client,
    engine: sa.Engine,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for reply_id in ("b-1", "b-2", "s-1"):
        ops.resolve(reply_id, reason="why", by="ops-anna")
        clock.advance(60)
    monkeypatch.setattr(audit_page, "PAGE_SIZE", 2)
    console = make_client()
    first = console.get("/audit").text
    assert [text for _, _, text in listed(first)] == ["s-1", "b-2"]
    older = older_link(first)
    assert older is not None
    task_id = pending_tasks(engine)[0]
    ops.cancel_task(task_id, reason="late", by="ops-bob")  # the newest of all now
    assert [text for _, _, text in listed(console.get(older).text)] == ["b-1"]
    assert [text for _, _, text in listed(console.get("/audit").text)] == [task_id, "s-1"]


def test_the_audit_lists_one_kind_when_asked_and_keeps_it_from_page_to_page(
    ops: Operations,
    make_client: Client,
    engine: sa.Engine,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = pending_tasks(engine)
    ops.cancel_task(first, reason="why", by="ops-anna")
    clock.advance(60)
    ops.resolve("b-1", reason="why", by="ops-anna")
    clock.advance(60)
    ops.cancel_task(second, reason="why", by="ops-bob")
    console = make_client()
    tasks_only = console.get("/audit?kind=tasks").text
    assert listed(tasks_only) == [
        ("task", task_link(second), second),
        ("task", task_link(first), first),
    ]
    assert '<option value="tasks" selected>tasks</option>' in tasks_only
    assert [text for _, _, text in listed(console.get("/audit?kind=replies").text)] == ["b-1"]
    assert [text for _, _, text in listed(console.get("/audit?kind=all").text)] == [
        second,
        "b-1",
        first,
    ]
    nobody = console.get("/audit?kind=tasks&by=ops-carl").text
    assert '<p id="no-audit">No decision about a task by ops-carl.</p>' in nobody
    monkeypatch.setattr(audit_page, "PAGE_SIZE", 1)
    page_one = console.get("/audit?kind=tasks").text
    older = older_link(page_one)
    assert older is not None
    assert "kind=tasks" in older
    assert "before=" not in older.replace("task_before=", "")  # no replies' start
    assert [text for _, _, text in listed(console.get(older).text)] == [first]


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("kind=dead", "kind: one of all, replies, tasks, not 'dead'"),
        ("before=abc", "before: not a decision id: 'abc'"),
        ("task_before=0", "task_before: not a decision id: '0'"),
        ("kind=tasks&task_before=-3", "task_before: not a decision id: '-3'"),
    ],
)
def test_a_bad_kind_or_start_is_refused_before_any_read(
    make_client: Client, query: str, why: str
) -> None:
    answer = make_client().get(f"/audit?{query}")
    assert answer.status_code == 400
    assert f'<p class="refused" id="audit-error">{why}</p>' in unescape(answer.text)
    assert '<table id="audit">' not in answer.text


def test_a_read_only_console_lists_both_kinds_and_offers_no_decision(
    ops: Operations, make_client: Client, engine: sa.Engine, clock: ManualClock
) -> None:
    [task_id, _] = pending_tasks(engine)
    ops.resolve("b-1", reason="why", by="ops-anna")
    clock.advance(60)
    ops.cancel_task(task_id, reason="why", by="ops-anna")
    page = make_client(read_only=True, operator="ops-anna").get("/audit")
    assert page.status_code == 200
    assert '<span class="badge">read-only</span>' in page.text
    assert [kind for kind, _, _ in listed(page.text)] == ["task", "reply"]
    assert 'method="post"' not in page.text.split("<main", 1)[1]


def test_the_audit_table_keeps_the_consoles_accessibility_conventions(
    ops: Operations, make_client: Client, engine: sa.Engine, clock: ManualClock
) -> None:
    [task_id, _] = pending_tasks(engine)
    ops.cancel_task(task_id, reason="why", by="ops-anna")
    clock.advance(60)
    ops.resolve("b-1", reason="why", by="ops-anna")
    page = make_client().get("/audit").text
    table = page.split('<table id="audit">', 1)[1].split("</table>", 1)[0]
    headers = re.findall(r"<th\b[^>]*>", table)
    assert headers
    assert all('scope="col"' in header for header in headers)
    # What each row is about is said in words, not by colour alone.
    assert re.findall(r'<td class="kind">(\w+)</td>', table) == ["reply", "task"]
    form = page.split('id="audit-filter"', 1)[1].split("</form>", 1)[0]
    # Each field inside its label.
    assert re.search(r"<label>about <select name=\"kind\">.*?</select></label>", form, re.DOTALL)
    assert '<label>by <input name="by"' in form


def test_an_operators_link_keeps_the_kind_the_page_shows(
    ops: Operations, make_client: Client, engine: sa.Engine
) -> None:
    [task_id, _] = pending_tasks(engine)
    ops.cancel_task(task_id, reason="why", by="ops-anna")
    tasks_only = make_client().get("/audit?kind=tasks").text
    assert '<a href="/audit?by=ops-anna&amp;kind=tasks">ops-anna</a>' in tasks_only
    every = make_client().get("/audit").text
    assert '<a href="/audit?by=ops-anna">ops-anna</a>' in every
