"""`outbox console`'s pages over a seeded database: overview, dead list, reply, task, search,
and the requeue, which is `outbox dead requeue`'s own."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.console_helpers import ConsoleClient, csrf_of
from support.operations_helpers import audit_rows
from support.receiver_helpers import SECRET, ReceiverProcess

from outbox.cli.console import pages, reads
from outbox.cli.console.security import CSRF_COOKIE
from outbox.operations import Operations
from outbox.schema import messages
from receiver import ReceiptStore

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
    page = make_client().get("/").text
    status = ops.status()
    assert (cell(page, "pending", "task-counts"), cell(page, "done", "task-counts")) == (2, 1)
    assert cell(page, "dead", "reply-counts") == status["messages"]["dead"] == 3
    assert cell(page, "pending", "reply-counts") == status["messages"]["pending"] == 1
    assert 'http-equiv="refresh"' in page


def test_the_overview_counts_backlog_and_dead_per_destination_unrouted_included(
    make_client: Client,
) -> None:
    page = make_client().get("/").text
    rows = dict(re.findall(r'<tr data-destination="([^"]+)">(.*?)</tr>', page, re.S))
    assert set(rows) == {"billing", "default", "shipping"}
    assert re.search(r'class="dead"><a href="/dead\?destination=billing">2<', rows["billing"])
    assert 'class="backlog">1<' in rows["default"]  # the done task's reply, waiting
    assert "no relay delivers it" in rows["default"]  # no relay announced it: unrouted


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
    page = make_client().get("/reply?id=s-1").text
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


def requeue(console: ConsoleClient, reply_id: str, **fields: str) -> object:
    """POST the requeue form of a reply's page, as the browser would."""
    console.get(f"/reply?id={reply_id}")
    csrf = console.cookies[CSRF_COOKIE]
    return console.post("/reply/requeue", data={"csrf_token": csrf, "reply_id": reply_id, **fields})


def test_without_a_receipt_lookup_a_requeue_is_refused_then_forced(
    ops: Operations, make_client: Client, engine: sa.Engine, no_relay_config: None
) -> None:
    console = make_client()
    refused = requeue(console, "b-1", reason="receiver was down", by="ops-anna")
    assert refused.status_code == 409  # type: ignore[attr-defined]
    text = refused.text  # type: ignore[attr-defined]
    assert "nothing could be asked whether the destination holds it" in text
    assert 'id="receipt">not checked<' in text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    assert audit_rows(engine) == []
    # The second, explicit step carries the same reason and operator, and force.
    form = dict(re.findall(r'name="([a-z_]+)" value="([^"]*)"', text.split('id="force-form"')[1]))
    assert form == {
        "csrf_token": csrf_of(text),
        "reply_id": "b-1",
        "reason": "receiver was down",
        "by": "ops-anna",
        "force": "yes",
    }
    done = console.post("/reply/requeue", data=form)
    assert done.status_code == 303
    [audit] = audit_rows(engine)
    assert (audit["requested_by"], audit["reason"], audit["forced"]) == (
        "ops-anna",
        "receiver was down",
        True,
    )
    assert (audit["receipt"], audit["previous_status"]) == ("not checked", 410)
    assert done.headers["location"] == f"/reply?id=b-1&requeued={audit['id']}"
    page = console.get(done.headers["location"]).text
    assert 'id="state">pending<' in page
    assert f"audit #{audit['id']}" in page
    assert 'class="by">ops-anna<' in page
    assert 'id="requeue-form"' not in page
    assert 'id="reply-counts"' in console.get("/").text
    assert cell(console.get("/").text, "dead", "reply-counts") == 2


@pytest.mark.parametrize("missing", ["reason", "by"])
def test_a_requeue_needs_a_reason_and_a_name(
    missing: str, ops: Operations, make_client: Client, no_relay_config: None
) -> None:
    fields = {"reason": "down", "by": "ops", "force": "yes"}
    fields[missing] = "  "
    answer = requeue(make_client(), "b-1", **fields)
    assert "a reason and the operator&#39;s name are both required" in answer.text  # type: ignore[attr-defined]
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]


def test_a_requeue_of_what_is_not_dead_is_refused(
    ops: Operations, make_client: Client, no_relay_config: None
) -> None:
    console = make_client()
    assert requeue(console, "b-1", reason="r", by="o", force="yes").status_code == 303  # type: ignore[attr-defined]
    again = requeue(console, "b-1", reason="r", by="o", force="yes")
    assert again.status_code == 409  # type: ignore[attr-defined]
    assert "message is pending, not dead" in again.text  # type: ignore[attr-defined]
    assert 'id="force-form"' not in again.text  # type: ignore[attr-defined]


@pytest.fixture
def relay_config(tmp_path: Path, seeded: str) -> Iterator[Path]:
    """A relay TOML whose destination "billing" is a real receiver with a receipt lookup."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    process = ReceiverProcess(seeded, secret_file).wait_ready()
    config = tmp_path / "relay.toml"
    config.write_text(
        f'[destinations.billing]\nurl = "{process.base}/replies"\n'
        f'secret_file = "{secret_file}"\nreceipt_lookup = true\n',
        encoding="utf-8",
    )
    yield config
    process.stop()


def test_a_requeue_asks_the_receipt_lookup_first_and_shows_what_it_said(
    seeded: str, ops: Operations, engine: sa.Engine, relay_config: Path, make_client: Client
) -> None:
    with engine.connect() as conn:
        body = conn.execute(
            sa.select(messages.c.body).where(messages.c.reply_id == "b-1")
        ).scalar_one()
    with ReceiptStore(seeded) as store:
        store.accept("b-1", bytes(body))  # the receiver holds it: only the ACK was lost
    console = make_client(config=str(relay_config))
    refused = requeue(console, "b-1", reason="check", by="ops-anna")
    assert "the destination already holds this exact message" in refused.text  # type: ignore[attr-defined]
    assert 'id="receipt">received<' in refused.text  # type: ignore[attr-defined]
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    # What the destination does not hold is requeued without force.
    assert requeue(console, "b-2", reason="down", by="ops-anna").status_code == 303  # type: ignore[attr-defined]
    [audit] = audit_rows(engine)
    assert (audit["reply_id"], audit["receipt"], audit["forced"]) == ("b-2", "not received", False)
