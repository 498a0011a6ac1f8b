"""The 3 a.m. story in a real browser, end to end: a destination starts failing, the
overview says so at its next load, the operator resolves one of its dead replies,
bulk-requeues the rest once it is back and sees them sent, and the audit lists both
decisions under the operator's name.

Real processes: the reference receiver as the destination (stopped, then started again
on its port), a relay, and the console; headless Chromium drives the console as a person
would (see test_console_browser for the browser's fixtures).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy.orm import Session
from support.console_helpers import OPERATOR, ConsoleProcess
from support.receiver_helpers import SECRET, ReceiverProcess, relay_toml, wait_until
from test_console_browser import browser, navigate  # noqa: F401 (browser: a fixture)

import outbox
import receiver
from outbox.drivers import driver_for
from outbox.operations import Operations
from outbox.schema import messages
from relay import Relay, make_destination

LEASE = 4.0
"""The relay's lease: it announces its last answers every quarter lease, a second here."""
SETTLED = 60.0
"""Seconds a step of the story may take on a busy machine."""


@pytest.fixture
def page(browser: WebDriver) -> Iterator[WebDriver]:  # noqa: F811 (the imported fixture)
    """The browser, its cookies forgotten after the test."""
    yield browser
    browser.delete_all_cookies()


def publish(engine: sa.Engine, *reply_ids: str) -> None:
    """Publish one reply to billing per id, each in its own transaction."""
    for reply_id in reply_ids:
        with Session(engine) as session, session.begin():
            outbox.publish(session, "billing", reply_id, {"invoice": reply_id})


def states(engine: sa.Engine, *reply_ids: str) -> list[str]:
    """The replies' states, in the order given."""
    with engine.connect() as conn:
        found = dict(
            conn.execute(
                sa.select(messages.c.reply_id, messages.c.state).where(
                    messages.c.reply_id.in_(reply_ids)
                )
            ).all()
        )
    return [found.get(reply_id, "") for reply_id in reply_ids]


def announced_failing(engine: sa.Engine) -> bool:
    """Whether the relay's announcement of billing says its last answer was a failure."""
    with engine.connect() as conn:
        rows = driver_for(engine).relay_announcements(conn)
    return any(
        row.last_failed_at is not None
        and (row.last_sent_at is None or row.last_failed_at > row.last_sent_at)
        for row in rows
    )


def health_state(page: WebDriver, destination: str) -> str:
    """The state the overview's health table shows for `destination`, in words."""
    row = page.find_element(By.CSS_SELECTOR, f"#health tr[data-destination='{destination}']")
    return str(row.find_element(By.CSS_SELECTOR, "span.state").text)


# On PostgreSQL, the production store: every part it drives passes the same tests on each
# backend, and the story takes some ten seconds a run.
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_failing_destination_is_seen_decided_about_and_delivered_at_3am(
    db_url: str, tmp_path: Path, page: WebDriver
) -> None:
    receiver.upgrade(db_url)  # the receiver keeps its receipts in the same database here
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    destination = ReceiverProcess(db_url, secret_file).wait_ready()
    config = relay_toml(tmp_path, "billing", destination.base, secret_file)
    relay = Relay(
        db_url,
        {
            "billing": make_destination(
                destination.base + "/replies", secret=SECRET, receipt_lookup=True, timeout=2.0
            )
        },
        owner="relay-billing",
        lease=LEASE,
        max_attempts=2,
        backoff=0.05,
        backoff_cap=0.1,
        poll_interval=0.1,
    )
    running = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    running.start()
    console = ConsoleProcess(
        db_url, tmp_path / "console.log", "--operator", OPERATOR, "--config", str(config)
    ).wait_ready()
    engine = outbox.create_engine(db_url)
    try:
        # Midnight: billing delivers.
        publish(engine, "inv-1", "inv-2")
        wait_until(lambda: states(engine, "inv-1", "inv-2") == ["sent"] * 2, SETTLED, "sent")
        # 3 a.m.: billing goes down; what is published meanwhile fails, then dies.
        destination.stop()
        down = [f"inv-{n}" for n in range(3, 7)]
        publish(engine, *down)
        wait_until(lambda: states(engine, *down) == ["dead"] * 4, SETTLED, "the replies to die")
        wait_until(lambda: announced_failing(engine), SETTLED, "the relay to announce it")
        # One load of the overview after the relay's announcement says it.
        page.get(console.base + "/")
        assert health_state(page, "billing") == "failing"
        why = page.find_element(By.CSS_SELECTOR, "#health tr[data-destination='billing'] .why")
        assert "last attempt failed (no answer)" in why.text
        # The operator opens billing's dead replies from its row.
        navigate(page, css="#health tr[data-destination='billing'] td.dead a")
        listed = page.find_elements(By.CSS_SELECTOR, "#dead tbody tr")
        assert sorted(row.get_attribute("data-reply-id") for row in listed) == down
        # One of them was refunded by hand: resolved from its page.
        navigate(page, link="inv-6")
        page.find_element(By.CSS_SELECTOR, "#resolve-form input[name='reason']").send_keys(
            "refunded by hand"
        )
        navigate(page, css="#resolve-form button")
        assert page.find_element(By.ID, "resolved").is_displayed()
        # Billing is back: the rest are requeued in bulk, counted first, then confirmed.
        destination = ReceiverProcess(db_url, secret_file, port=destination.port).wait_ready()
        page.get(console.base + "/dead?destination=billing")
        page.find_element(By.CSS_SELECTOR, "#bulk-form input[name='reason']").send_keys(
            "billing is back"
        )
        navigate(page, css="#bulk-form button")
        assert page.find_element(By.ID, "bulk-count").text.startswith("3 dead replies match")
        assert states(engine, *down) == ["dead", "dead", "dead", "resolved"]  # nothing yet
        navigate(page, css="#bulk-confirm button")
        done = page.find_element(By.CSS_SELECTOR, "#bulk-done li[data-outcome='requeued']")
        assert done.text == "requeued: 3"
        # The relay delivers them; their pages say sent.
        wait_until(lambda: states(engine, *down[:3]) == ["sent"] * 3, SETTLED, "the requeued")
        page.get(console.base + "/reply?id=inv-3")
        assert page.find_element(By.ID, "state").text == "sent"
        # The audit lists both decisions under the operator's name.
        navigate(page, link="audit")
        rows = page.find_elements(By.CSS_SELECTOR, "#audit tbody tr")
        decided = sorted(
            (
                row.find_element(By.CSS_SELECTOR, ".action").text,
                row.find_element(By.CSS_SELECTOR, ".reply").text,
                row.find_element(By.CSS_SELECTOR, ".by").text,
            )
            for row in rows
        )
        assert decided == [
            ("requeue", "inv-3", OPERATOR),
            ("requeue", "inv-4", OPERATOR),
            ("requeue", "inv-5", OPERATOR),
            ("resolve", "inv-6", OPERATOR),
        ]
        with Operations(db_url) as ops:
            assert ops.status()["messages"]["dead"] == 0
    finally:
        relay.stop()
        running.join(timeout=30)
        relay.close()
        console.stop()
        destination.stop()
        engine.dispose()
