"""`outbox console` in a real browser: headless Chromium, driven as a person would, against a
real console process over a seeded database, on both backends.

Needs Debian's `chromium` and `chromium-driver` (.ci/run installs them). Under CI=true a
missing browser fails the run, as a missing PostgreSQL does; elsewhere it skips.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from support.console_helpers import OPERATOR, TOKEN, ConsoleProcess
from support.environment import IN_CI
from support.receiver_helpers import wait_until

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """Headless Chromium; fails under CI, skips elsewhere, when it is not installed."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        missing = "chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
        if IN_CI:
            pytest.fail(f"the browser tests need {missing} under CI=true")
        pytest.skip(f"the browser tests need {missing}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def console(seeded: str, tmp_path: Path) -> Iterator[ConsoleProcess]:
    """A console process on the seeded database, loopback, no token, an operator set."""
    process = ConsoleProcess(seeded, tmp_path / "console.log", "--operator", OPERATOR)
    process.wait_ready()
    yield process
    process.stop()


@pytest.fixture
def page(browser: WebDriver) -> Iterator[WebDriver]:
    """The browser, its cookies forgotten after the test."""
    yield browser
    browser.delete_all_cookies()


def navigate(driver: WebDriver, css: str = "", link: str = "") -> None:
    """Click the element (a CSS selector, or a link by its text) and wait for the next page.

    Without the wait, the next lookup may find the old page's elements, or find them
    gone stale halfway through reading them.
    """
    old = driver.find_element(By.TAG_NAME, "html")
    target = (
        driver.find_element(By.LINK_TEXT, link)
        if link
        else driver.find_element(By.CSS_SELECTOR, css)
    )
    target.click()

    def replaced(_: WebDriver) -> bool:
        try:
            old.is_enabled()
        except WebDriverException:
            # Stale, or (Chromium's other wording) "does not belong to the document".
            return True
        return False

    WebDriverWait(driver, 15).until(replaced)


def count(driver: WebDriver, table: str, state: str) -> int:
    """The count an overview table shows for `state`."""
    return int(driver.find_element(By.CSS_SELECTOR, f"#{table} td[data-state='{state}']").text)


def test_the_overview_shows_the_seeded_counts(console: ConsoleProcess, page: WebDriver) -> None:
    page.get(console.base + "/")
    assert count(page, "task-counts", "pending") == 2
    assert count(page, "task-counts", "done") == 1
    assert count(page, "reply-counts", "dead") == 3
    assert count(page, "reply-counts", "pending") == 1
    # The health table lists what waits (the task's reply); the seeded dead replies died
    # long before this real clock's last hour, and no relay runs: none of theirs is listed.
    waiting = page.find_element(By.CSS_SELECTOR, "tr[data-destination='default'] td.backlog")
    assert waiting.text == "1"
    assert [
        row.get_attribute("data-state")
        for row in page.find_elements(By.CSS_SELECTOR, "#health tbody tr")
    ] == ["unrouted"]
    assert len(page.find_elements(By.CSS_SELECTOR, ".chart svg polyline")) == 8


def test_a_dead_reply_found_by_filter_is_requeued_and_shows_as_pending(
    console: ConsoleProcess, page: WebDriver
) -> None:
    page.get(console.base + "/dead")
    page.find_element(By.NAME, "error").send_keys("conflict")
    navigate(page, css="#filters button")
    rows = page.find_elements(By.CSS_SELECTOR, "#dead tbody tr")
    assert [row.get_attribute("data-reply-id") for row in rows] == ["b-2"]
    navigate(page, link="b-2")
    assert not page.find_elements(By.NAME, "by")  # the name is the console's, not typed
    page.find_element(By.NAME, "reason").send_keys("billing fixed the conflict")
    navigate(page, css="#requeue-form button")
    # No receipt lookup is configured: refused first, with what the lookup said.
    assert page.find_element(By.ID, "receipt").text == "not checked"
    assert page.find_element(By.ID, "state").text == "dead"
    navigate(page, css="#force-form button")
    assert "Requeued" in page.find_element(By.ID, "requeued").text
    assert page.find_element(By.ID, "state").text == "pending"
    assert page.find_element(By.CSS_SELECTOR, "#decisions td.by").text == OPERATOR
    navigate(page, link="overview")
    assert count(page, "reply-counts", "pending") == 2
    assert count(page, "reply-counts", "dead") == 2


def test_a_body_holding_a_script_does_not_run(console: ConsoleProcess, page: WebDriver) -> None:
    page.get(console.base + "/reply?id=s-1")
    body = page.find_element(By.ID, "body").text
    assert "<script>document.title='ran'</script>" in body  # shown as text
    assert page.title == "reply s-1 · outbox console"  # and never run
    assert page.execute_script("return document.scripts.length") == 0


def test_a_cross_site_post_without_the_csrf_token_is_refused(
    console: ConsoleProcess, page: WebDriver, tmp_path: Path
) -> None:
    page.get(console.base + "/reply?id=b-1")  # the browser holds the console's cookies
    attack = tmp_path / "attack.html"
    attack.write_text(
        f'<form method="post" action="{console.base}/reply/requeue">'
        '<input name="reply_id" value="b-1"><input name="reason" value="x">'
        '<input name="by" value="x"><input name="force" value="yes">'
        '<button id="go" type="submit">go</button></form>',
        encoding="utf-8",
    )
    page.get(attack.as_uri())
    navigate(page, css="#go")
    wait_until(lambda: "403" in page.page_source, 10, "the console to refuse the POST")
    page.get(console.base + "/reply?id=b-1")
    assert page.find_element(By.ID, "state").text == "dead"


@pytest.fixture
def guarded(seeded: str, tmp_path: Path) -> Iterator[ConsoleProcess]:
    """A console process that asks for the token."""
    process = ConsoleProcess(seeded, tmp_path / "console.log", token=TOKEN).wait_ready()
    yield process
    process.stop()


def test_a_wrong_or_missing_token_gets_401_and_the_right_one_opens(
    guarded: ConsoleProcess, page: WebDriver
) -> None:
    assert httpx.get(guarded.base + "/").status_code == 401
    wrong = httpx.get(guarded.base + "/", headers={"Authorization": "Bearer wrong-token-here"})
    assert wrong.status_code == 401
    right = httpx.get(guarded.base + "/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert right.status_code == 200
    page.get(guarded.base + "/dead")
    page.find_element(By.NAME, "operator").send_keys("ops-lee")
    page.find_element(By.NAME, "token").send_keys("not-the-token")
    navigate(page, css="#login button")
    assert page.find_element(By.ID, "wrong-token").is_displayed()
    assert not page.find_elements(By.ID, "dead")
    page.find_element(By.NAME, "token").send_keys(TOKEN)
    navigate(page, css="#login button")
    assert page.current_url == guarded.base + "/dead"
    assert len(page.find_elements(By.CSS_SELECTOR, "#dead tbody tr")) == 3
    assert page.execute_script("return document.cookie") == ""  # HttpOnly: out of reach
    assert page.find_element(By.ID, "operator").text == "signed in as ops-lee"
