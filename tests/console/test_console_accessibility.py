"""Every console page, checked by axe-core in the browser: no serious or critical
violation (labels, contrast, structure), in light mode and in dark mode (the system's
setting, emulated), and readable 1,024 pixels wide without scrolling sideways.

axe-core comes bundled with selenium-axe-python, injected through the WebDriver (the
pages' own policy runs no script, so nothing of theirs can interfere).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium_axe_python import Axe
from support.console_helpers import OPERATOR, ConsoleProcess
from test_console_browser import browser, navigate  # noqa: F401 (browser: a fixture)

from outbox.drivers import driver_for
from outbox.drivers.records import LastAnswers
from outbox.operations import Operations
from outbox.schema import tasks

BLOCKING = ("serious", "critical")
"""The impacts a page may not have."""
NARROW = 1024
PAGES = (
    "/",
    "/dead",
    "/dead?destination=billing",
    "/replies?state=dead",
    "/replies?state=sent&order=oldest",
    "/reply?id=b-1",
    "/audit",
    "/login",
    "/search?q=nothing",  # the page saying it is missing
)


@pytest.fixture
def console(seeded: str, ops: Operations, tmp_path: Path) -> Iterator[ConsoleProcess]:
    """A console process on the seeded database, with a failing, a degraded and a healthy
    destination, a live relay and worker, and a decision in the audit. On the database's
    clock, as the console process reads it (the seed's manual clock is decades back)."""
    now = None
    with ops.engine.begin() as conn:
        driver_for(ops.engine).announce(
            conn,
            owner="relay-1",
            destinations=["billing", "shipping", "quiet"],
            lease=7200,
            now=now,
            answers={
                "billing": LastAnswers(600.0, 5.0, 503, "HTTP 503: down"),
                "shipping": LastAnswers(1.0, 300.0, 500, "HTTP 500: boom"),
                "quiet": LastAnswers(2.0, None, None, None),
            },
        )
        driver_for(ops.engine).announce_worker(
            conn, owner="worker-1", handler="app.handle", concurrency=4, lease=7200, now=now
        )
    ops.resolve("s-1", reason="shipped by hand", by=OPERATOR)
    process = ConsoleProcess(seeded, tmp_path / "console.log", "--operator", OPERATOR)
    process.wait_ready()
    yield process
    process.stop()


@pytest.fixture
def page(browser: WebDriver) -> Iterator[WebDriver]:  # noqa: F811 (the imported fixture)
    """The browser at the console's usual width, light mode, its cookies forgotten after."""
    browser.set_window_size(1280, 1000)
    yield browser
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})  # type: ignore[attr-defined]
    browser.set_window_size(1280, 1000)
    browser.delete_all_cookies()


def task_page(console: ConsoleProcess) -> str:
    """The path of a seeded pending task's page (its cancel form shown)."""
    engine = sa.create_engine(console.db_url)
    try:
        with engine.connect() as conn:
            pending = sa.select(tasks.c.task_id).where(tasks.c.state == "pending").limit(1)
            task_id = conn.execute(pending).scalar_one()
    finally:
        engine.dispose()
    return f"/task?id={task_id}"


def blocking(page: WebDriver) -> list[str]:
    """axe-core's serious and critical violations of the page shown, one line each."""
    axe = Axe(page)
    axe.inject()
    results: dict[str, Any] = axe.run()
    return [
        f"{violation['id']} ({violation['impact']}): {node['target']} {node['failureSummary']}"
        for violation in results["violations"]
        if violation["impact"] in BLOCKING
        for node in violation["nodes"]
    ]


def dark(page: WebDriver) -> None:
    """Emulate a system set to dark mode."""
    page.execute_cdp_cmd(  # type: ignore[attr-defined]
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
    )


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["light", "dark"])
def test_no_page_has_a_serious_or_critical_violation(
    console: ConsoleProcess, page: WebDriver, mode: str
) -> None:
    if mode == "dark":
        dark(page)
    # Every state's badge is on the page axe checks, live and lapsed alike.
    page.get(console.base + "/")
    shown = {e.text for e in page.find_elements(By.CSS_SELECTOR, "#health span.state")}
    assert shown == {"failing", "degraded", "healthy", "unrouted"}, shown
    assert page.find_elements(By.CSS_SELECTOR, "#relays span.state-healthy")
    found = {}
    for path in (*PAGES, task_page(console)):
        page.get(console.base + path)
        assert page.execute_script(  # the emulation took
            "return matchMedia('(prefers-color-scheme: dark)').matches"
        ) == (mode == "dark")
        found[path] = blocking(page)
    # The bulk decision's count page and its result, and a refused requeue's force form,
    # reached as a person does.
    page.get(console.base + "/reply?id=b-1")
    page.find_element(By.CSS_SELECTOR, "#requeue-form input[name='reason']").send_keys("back")
    navigate(page, css="#requeue-form button")
    assert page.find_elements(By.ID, "force-form")
    found["refused requeue"] = blocking(page)
    page.get(console.base + "/dead?destination=billing")
    page.find_element(By.CSS_SELECTOR, "#bulk-form input[name='reason']").send_keys("back")
    page.find_element(By.CSS_SELECTOR, "#bulk-form input[value='resolve']").click()
    navigate(page, css="#bulk-form button")
    found["bulk count"] = blocking(page)
    navigate(page, css="#bulk-confirm button")
    found["bulk result"] = blocking(page)
    assert {path: lines for path, lines in found.items() if lines} == {}, found


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_every_page_reads_1024_pixels_wide_without_scrolling_sideways(
    console: ConsoleProcess, page: WebDriver
) -> None:
    page.set_window_size(NARROW, 900)
    assert page.execute_script("return window.innerWidth") == NARROW
    overflow = {}
    for path in PAGES:
        page.get(console.base + path)
        # The width the page's content takes beyond what is shown (a vertical scroll bar's
        # width is not shown content): 0 when nothing needs scrolling sideways.
        overflow[path] = page.execute_script(
            "const e = document.documentElement; return e.scrollWidth - e.clientWidth"
        )
    assert overflow == dict.fromkeys(PAGES, 0), overflow


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_keyboard_reaches_every_link_and_control_of_the_overview_in_order(
    console: ConsoleProcess, page: WebDriver
) -> None:
    page.get(console.base + "/?refresh=off")  # no reload halfway through
    expected = page.execute_script(
        "return [...document.querySelectorAll("
        "'a[href], button, input:not([type=hidden]), select, textarea')]"
    )
    assert len(expected) > 5  # the navigation, the search, the pause link, the dead links
    for step, element in enumerate(expected):
        page.switch_to.active_element.send_keys("\t")
        active = page.switch_to.active_element
        assert active == element, f"tab {step + 1} reached {active.tag_name} {active.text!r}"
        # And shows where it is: the focus outline.
        assert active.value_of_css_property("outline-style") != "none", active.text
