"""`outbox console` against bad input: NUL bytes, numbers out of range, JSON nested too
deep, values too large to show whole. Each is answered 400 or shown as text (cut when
large), and a failure is a short 500 whose log line holds no request parameter."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from support.console_helpers import ConsoleClient

from outbox.operations import Operations
from outbox.schema import messages, tasks
from outbox_cli.console import reads
from outbox_cli.console.forms import CSRF_COOKIE
from outbox_cli.console.reads import CUT, ERROR_LISTED, ERROR_SHOWN, TEXT_SHOWN

Client = Callable[..., ConsoleClient]


@pytest.mark.parametrize(
    "path",
    ["/dead?destination=a%00b", "/dead?error=%00", "/dead?status=%00", "/dead?after=%00",
     "/reply?id=b%001", "/task?id=%00", "/search?q=%00", "/?x=%00", "/login?next=/%00",
     "/dead?a%00=1"],
)  # fmt: skip
def test_a_nul_byte_in_the_query_is_refused(path: str, make_client: Client) -> None:
    # PostgreSQL refuses NUL in text: the query raised and the page answered 500.
    answer = make_client().get(path)
    assert answer.status_code == 400
    assert "NUL" in answer.text


def test_a_nul_byte_in_a_form_is_refused(
    ops: Operations, make_client: Client, no_relay_config: None
) -> None:
    console = make_client()
    console.get("/")
    form = {"csrf_token": console.cookies[CSRF_COOKIE], "reason": "r", "force": "yes"}
    for reply_id in ("b-1\x00", "\x00"):
        answer = console.post("/reply/requeue", data={**form, "reply_id": reply_id})
        assert answer.status_code == 400
        assert "NUL" in answer.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]


@pytest.mark.parametrize(
    ("query", "named"),
    [("status=99999999999999999999", "status"), ("status=2147483648", "status"),
     ("after=99999999999999999999", "after"), ("after=9223372036854775808", "after"),
     ("after=-5", "after"), ("since=" + "9" * 400 + "d", "since"),
     ("until=" + "9" * 400 + "d", "until")],
)  # fmt: skip
def test_a_number_out_of_range_is_said_on_the_page(
    query: str, named: str, make_client: Client
) -> None:
    # The database refused the bigint (500); a duration too large for a float raised.
    answer = make_client().get(f"/dead?{query}")
    assert answer.status_code == 400
    assert named in answer.text
    assert 'id="filter-error"' in answer.text


def test_the_largest_numbers_still_filter(make_client: Client) -> None:
    console = make_client()
    assert console.get("/dead?status=2147483647").status_code == 200
    assert console.get("/dead?after=9223372036854775807").status_code == 200


def first_task_id(engine: sa.Engine) -> str:
    """The seeded done task's id (it has a result and a reply)."""
    with engine.connect() as conn:
        found = conn.execute(
            sa.select(tasks.c.task_id).where(tasks.c.result.is_not(None))
        ).scalar_one()
    return str(found)


def shown(page: str, element: str) -> str:
    """The text of the <pre> with id `element`, unescaped enough to compare."""
    found = re.search(rf'<pre id="{element}">(.*?)</pre>', page, re.S)
    assert found is not None, f"no {element}"
    return found[1].replace("&#34;", '"')


def test_json_nested_too_deep_to_parse_is_shown_as_text(
    engine: sa.Engine, make_client: Client
) -> None:
    task_id = first_task_id(engine)
    deep = "[" * 100_000 + "]" * 100_000  # stored by plain SQL: nothing checked it
    with engine.begin() as conn:
        conn.execute(
            tasks.update().where(tasks.c.task_id == task_id).values(payload=deep, result=deep)
        )
    page = make_client().get(f"/task?id={task_id}")
    assert page.status_code == 200
    assert shown(page.text, "payload") == deep[:TEXT_SHOWN] + CUT


def test_json_nested_within_reach_is_pretty_printed_and_cut(
    engine: sa.Engine, make_client: Client
) -> None:
    # Indented, 900 levels grow to over a megabyte: the indented text is cut as well.
    task_id = first_task_id(engine)
    nested = "[" * 900 + "]" * 900
    with engine.begin() as conn:
        conn.execute(tasks.update().where(tasks.c.task_id == task_id).values(payload=nested))
    page = make_client().get(f"/task?id={task_id}").text
    payload = shown(page, "payload")
    assert payload.startswith("[\n  [\n    [")
    assert payload.endswith(CUT)
    assert len(payload) == TEXT_SHOWN + len(CUT)


def test_a_large_payload_result_and_errors_are_cut_as_bodies_are(
    engine: sa.Engine, make_client: Client
) -> None:
    # A 40 MB payload was a 40 MB page.
    task_id = first_task_id(engine)
    huge = '{"x": "' + "a" * (3 * TEXT_SHOWN) + '"}'
    with engine.begin() as conn:
        conn.execute(
            tasks.update()
            .where(tasks.c.task_id == task_id)
            .values(payload=huge, result=huge, last_error="e" * (3 * TEXT_SHOWN))
        )
        conn.execute(
            messages.update()
            .where(messages.c.reply_id == "b-1")
            .values(last_error="f" * (3 * TEXT_SHOWN))
        )
    console = make_client()
    page = console.get(f"/task?id={task_id}").text
    assert shown(page, "payload") == huge[:TEXT_SHOWN] + CUT
    assert shown(page, "result") == huge[:TEXT_SHOWN] + CUT
    assert "e" * ERROR_SHOWN + CUT in page
    assert "e" * (ERROR_SHOWN + 1) not in page
    reply = console.get("/reply?id=b-1").text
    assert "f" * ERROR_SHOWN + CUT in reply
    assert "f" * (ERROR_SHOWN + 1) not in reply
    listed = console.get("/dead").text
    assert "f" * ERROR_LISTED + CUT in listed
    assert "f" * (ERROR_LISTED + 1) not in listed


def test_a_failing_page_is_a_short_500_that_logs_no_parameter(
    make_client: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secretive = "asked-for-this-value"

    def fails(self: reads.ConsoleReads, task_id: str) -> None:
        raise sa.exc.DataError("SELECT ... WHERE task_id = %(id)s", {"id": task_id}, None)

    monkeypatch.setattr(reads.ConsoleReads, "task", fails)
    with caplog.at_level(logging.ERROR, logger="outbox.console"):
        answer = make_client().get(f"/task?id={secretive}")
    assert answer.status_code == 500
    assert secretive not in answer.text
    assert "Traceback" not in answer.text
    assert "DataError" in caplog.text
    assert secretive not in caplog.text
    assert all(record.exc_info is None for record in caplog.records)
