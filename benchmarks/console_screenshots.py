"""Screenshots of `outbox console` for the docs, from a real run.

Run: .venv/bin/python -m benchmarks.console_screenshots [--db URL] [--out docs/assets/console]
(or `make screenshots`).

Seeds a database through the public API (outbox.publish, TaskQueue, Operations'
requeue and resolve) with an hour of per-minute activity: replies to three
destinations, most sent, some dead with the errors a destination gives, a few
still pending; tasks in every state; dead replies requeued and dead again. Then
starts a real `outbox console` process asking for a token, and drives headless
Chromium through its pages, writing one PNG of each to --out. Without --db the
database is a new SQLite file (the embedded default), deleted afterwards.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import sqlalchemy as sa
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy.orm import Session

import outbox
from benchmarks.console_pages import console_process
from benchmarks.relay_bench import ROOT, log
from outbox import AuthContext, Envelope, TaskQueue
from outbox.drivers import driver_for
from outbox.drivers.records import LastAnswers
from outbox.operations import Operations
from outbox.schema import backlog_samples, failed_attempts, messages
from outbox.testing import ManualClock

TOKEN = "screenshot-console-token-0123456789"  # noqa: S105 (a throwaway run's)
WIDTH, HEIGHT = 1280, 800
TALLEST = 2300
MINUTES = 60
DESTINATIONS = ("billing", "shipping", "crm-webhook")
TASK_REPLIES = "orders-callback"
ROUTED = ("billing", "shipping", TASK_REPLIES)
"""Destinations a live relay delivers (crm-webhook's relay is down: its replies wait)."""
ERRORS = {
    "billing": ((409, "HTTP 409 conflict: invoice INV-{n} already settled"), (410, "HTTP 410")),
    "shipping": ((422, "HTTP 422: unknown warehouse 'eu-7'"), (None, "outcome unknown: timeout")),
    "crm-webhook": ((500, "HTTP 500: internal error"), (None, "connection refused")),
}
"""Per destination, the (last status, last error) its dead replies died with."""


@dataclass
class Seeded:
    """What the screenshots show: ids picked while seeding."""

    dead_requeued: str = ""
    failed_task: str = ""
    sent_reply: str = ""
    dead: list[str] = field(default_factory=list)


def rate(minute: int) -> int:
    """Replies published in `minute`: a daily-looking swell with a burst near the end."""
    swell = 6 + 4 * math.sin(minute / 9)
    return round(swell + (14 if 38 <= minute < 44 else 0))


def sent_update() -> sa.Update:
    """A reply delivered: as the relay's settle leaves it."""
    return (
        messages.update()
        .where(messages.c.reply_id == sa.bindparam("rid"))
        .values(state="sent", attempts=1, fence=1, sent_at=sa.bindparam("at"), last_status=200)
    )


def dead_update() -> sa.Update:
    """A reply given up on after its attempts, with the destination's last answer."""
    return (
        messages.update()
        .where(messages.c.reply_id == sa.bindparam("rid"))
        .values(
            state="dead",
            attempts=sa.bindparam("tries"),
            fence=sa.bindparam("tries"),
            available_at=sa.bindparam("at"),
            last_status=sa.bindparam("status"),
            last_error=sa.bindparam("error"),
        )
    )


def seed_replies(engine: sa.Engine, now: float, rng: random.Random, seeded: Seeded) -> None:
    """An hour of replies: each minute's published, then most sent, some dead, the last
    few minutes' (and crm-webhook's recent ones) still pending."""
    clock = ManualClock(now - MINUTES * 60)
    sent: list[dict[str, Any]] = []
    dead: list[dict[str, Any]] = []
    for minute in range(MINUTES):
        published = []
        with Session(engine) as session, session.begin():
            for n in range(rate(minute)):
                destination = rng.choices(DESTINATIONS, (5, 3, 2))[0]
                reply_id = f"{destination[:4]}-{minute:02d}{n:02d}-{rng.randrange(16**6):06x}"
                body = {"order": f"ORD-{rng.randrange(10**6):06d}", "total": rng.randrange(9999)}
                outbox.publish(session, destination, reply_id, body, clock=clock)
                published.append((destination, reply_id, clock()))
                clock.advance(60 / rate(minute))
        for destination, reply_id, created in published:
            waiting = destination == "crm-webhook" and minute >= 50
            if minute >= MINUTES - 2 or waiting:
                continue
            if rng.random() < (0.25 if 38 <= minute < 44 else 0.03):
                status, error = rng.choice(ERRORS[destination])
                tries = rng.randint(3, 8)
                died = created + 30 * tries
                text = error.format(n=rng.randrange(10**5))
                dead.append(
                    {"rid": reply_id, "tries": tries, "at": died, "status": status, "error": text}
                )
            else:
                sent.append({"rid": reply_id, "at": created + rng.uniform(0.05, 1.5)})
    with engine.begin() as conn:
        conn.execute(sent_update(), sent)
        conn.execute(dead_update(), dead)
    seeded.sent_reply = sent[len(sent) // 2]["rid"]
    seeded.dead = [row["rid"] for row in dead]
    seed_attempts(engine, dead)


def attempts_until(
    message_id: int, tries: int, died: float, status: int, error: str
) -> list[dict[str, Any]]:
    """A dead reply's failed attempts, 30 s apart: retries the destination answered 503, then
    the death its row holds."""
    return [
        {
            "message_id": message_id,
            "attempt": k,
            "state": "dead" if k == tries else "pending",
            "status": status if k == tries else 503,
            "error": error if k == tries else "HTTP 503: service unavailable",
            "attempted_at": died - 30 * (tries - k),
        }
        for k in range(1, tries + 1)
    ]


def seed_attempts(engine: sa.Engine, dead: list[dict[str, Any]]) -> None:
    """The failed attempts the relays would have recorded on the way to each death."""
    with engine.begin() as conn:
        ids = dict(conn.execute(sa.select(messages.c.reply_id, messages.c.id)).all())
        rows = [
            row
            for d in dead
            for row in attempts_until(ids[d["rid"]], d["tries"], d["at"], d["status"], d["error"])
        ]
        conn.execute(sa.insert(failed_attempts), rows)


SAMPLES_MISSED = range(22, 25)
"""Minutes of the hour no relay sampled (every relay restarting for a deploy): a gap."""


def seed_samples(engine: sa.Engine, now: float) -> None:
    """The relays' samples of the hour: each minute, each destination's undelivered replies
    as the seeded rows say they were then (a reply is done with when it was sent or first
    died: a requeued one's later life is left out)."""
    with engine.begin() as conn:
        died = dict(
            conn.execute(
                sa.select(failed_attempts.c.message_id, sa.func.min(failed_attempts.c.attempted_at))
                .where(failed_attempts.c.state == "dead")
                .group_by(failed_attempts.c.message_id)
            ).all()
        )
        lives = [
            (destination, created, min(t for t in (sent_at, died.get(id_), done) if t is not None))
            if sent_at is not None or id_ in died or done is not None
            else (destination, created, math.inf)
            for id_, destination, created, sent_at, done in conn.execute(
                sa.select(
                    messages.c.id,
                    messages.c.destination,
                    messages.c.created_at,
                    messages.c.sent_at,
                    sa.case((messages.c.state.in_(("dead", "resolved")), messages.c.available_at)),
                )
            )
        ]
        samples = []
        for minute in range(MINUTES):
            if minute in SAMPLES_MISSED:
                continue
            at = math.floor((now - (MINUTES - minute) * 60) / 60) * 60
            # A relay samples its own destinations with nothing waiting too.
            waiting: dict[str, list[float]] = {name: [] for name in ROUTED}
            for destination, created, gone in lives:
                if created <= at < gone:
                    waiting.setdefault(destination, []).append(created)
            samples += [
                {
                    "sampled_at": at,
                    "destination": name,
                    "backlog": len(created),
                    "oldest_age": at - min(created) if created else None,
                }
                for name, created in waiting.items()
            ]
        conn.execute(sa.insert(backlog_samples), samples)


def seed_requeues(url: str, engine: sa.Engine, now: float, seeded: Seeded) -> None:
    """A requeue history: one reply requeued and dead again, twice; one resolved."""
    again, resolved = seeded.dead[0], seeded.dead[1]
    # Each requeue three minutes before the death that follows it, and the resolve now.
    clock = ManualClock(now - 780)
    with Operations(url, clock=clock) as ops:
        for attempt, (who, why) in enumerate(
            (
                ("ops-anna", "billing deployed the fix for INV conflicts"),
                ("ops-ravi", "second try after billing's rollback"),
            )
        ):
            ops.requeue(again, reason=why, by=who, receipt="not received", forced=False)
            with engine.begin() as conn:
                died = {
                    "rid": again,
                    "tries": 5,
                    "at": now - 600 + attempt * 300,
                    "status": 409,
                    "error": "HTTP 409 conflict: invoice already settled",
                }
                conn.execute(dead_update(), died)
            seed_attempts(engine, [died])
            clock.advance(300)
        clock.advance(now - clock())
        ops.resolve(resolved, reason="confirmed delivered by the destination's team", by="ops-lee")
    seeded.dead_requeued = again


def seed_tasks(url: str, now: float, rng: random.Random, seeded: Seeded) -> None:
    """An hour of tasks from one source: most done, some failed, one cancelled, one expired,
    a few running and pending at the end."""
    clock = ManualClock(now - MINUTES * 60 + 5)
    with TaskQueue(
        url, clock=clock, allowed_sources=("orders-api",), reply_destination=TASK_REPLIES
    ) as queue:
        source = AuthContext("orders-api")
        for minute in range(MINUTES):
            for n in range(max(1, rate(minute) // 2)):
                payload = {"kind": "charge", "order": f"ORD-{minute:02d}{n:02d}", "cents": 1299}
                envelope = Envelope(f"task-{minute:02d}-{n:02d}", "orders-api", payload, now + 3600)
                queue.receive(source, envelope)
            if minute >= MINUTES - 1:
                break  # the last minute's stay pending
            while (claim := queue.claim(f"worker-{rng.randint(1, 3)}")) is not None:
                if rng.random() < 0.06:
                    reason = "card declined: insufficient funds"
                    queue.fail(claim, reason, permanent=True)
                    seeded.failed_task = seeded.failed_task or claim.task_id
                else:
                    queue.finish(claim, {"charged": claim.payload["cents"], "ok": True})
            clock.advance(60)
        late = Envelope("task-late", "orders-api", {"kind": "charge"}, clock() + 30)
        queue.receive(source, late)
        cancelled = Envelope("task-cancelled", "orders-api", {"kind": "refund"}, now + 3600)
        task_id = queue.receive(source, cancelled).task_id
    # Cancelled by an operator, as the console's task page does: audited.
    with Operations(url, clock=clock) as ops:
        ops.cancel_task(
            task_id, reason="customer withdrew the order", by="ops-ravi",
            reply_destination=TASK_REPLIES,
        )  # fmt: skip
    with TaskQueue(
        url, clock=clock, allowed_sources=("orders-api",), reply_destination=TASK_REPLIES
    ) as queue:
        clock.advance(60)
        queue.reconcile()  # task-late's deadline has passed: expired
        queue.claim("worker-1")  # one running


def task_replies_sent(destination: str, before: float) -> sa.Update:
    """Task replies created before `before` delivered, each a moment after it was written."""
    return (
        messages.update()
        .where(
            messages.c.destination == destination,
            messages.c.state == "pending",
            messages.c.created_at < before,
        )
        .values(state="sent", attempts=1, fence=1, sent_at=messages.c.created_at + 0.4)
    )


ANSWERS = {
    "billing": LastAnswers(20.0, 180.0, 409, "HTTP 409 conflict: invoice INV-1042 already settled"),
    "shipping": LastAnswers(360.0, 4.0, 503, "HTTP 503: upstream warehouse API unavailable"),
    TASK_REPLIES: LastAnswers(2.0, None, None, None),
}
"""Each routed destination's last answers as its relay announces them: billing refuses
one invoice in a while (degraded), shipping fails now (failing), orders-callback delivers."""
WORKERS = (("worker-a1", 0.0), ("worker-a2", 4.0), ("worker-old", 900.0))
"""(owner, seconds since its last heartbeat): the last one stopped without withdrawing."""


def seed_relays(engine: sa.Engine, now: float) -> None:
    """Live relays for the routed destinations, with their last answers (heartbeats valid
    an hour), and the workers' announcements."""
    driver = driver_for(engine)
    with engine.begin() as conn:
        for destination in ROUTED:
            driver.announce(
                conn,
                owner=f"relay-{destination}",
                destinations=[destination],
                lease=3600,
                now=now,
                answers={destination: ANSWERS[destination]},
            )
        for owner, heard in WORKERS:
            driver.announce_worker(
                conn,
                owner=owner,
                handler="orders.tasks.handle",
                concurrency=8,
                lease=40,
                now=now - heard,
            )


def seed(url: str) -> Seeded:
    """The whole database the screenshots show."""
    rng = random.Random(7)  # the same pictures each run
    now = time.time()
    seeded = Seeded()
    engine = outbox.create_engine(url)
    try:
        seed_replies(engine, now, rng, seeded)
        seed_requeues(url, engine, now, seeded)
        seed_tasks(url, now, rng, seeded)
        with engine.begin() as conn:
            conn.execute(task_replies_sent(TASK_REPLIES, now - 120))
        seed_relays(engine, now)
        seed_samples(engine, now)
    finally:
        engine.dispose()
    return seeded


@contextmanager
def chromium() -> Iterator[WebDriver]:
    """Headless Chromium with a WIDTH x HEIGHT viewport."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        raise SystemExit("needs chromium and chromium-driver (apt-get install ...)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={WIDTH},{HEIGHT}")
    browser = webdriver.Chrome(options=options, service=Service(driver))
    browser.set_page_load_timeout(30)
    try:
        yield browser
    finally:
        browser.quit()


def shoot(browser: WebDriver, base: str, seeded: Seeded, out: Path) -> list[Path]:
    """Walk the pages as an operator would, saving each; the files written."""
    written = []

    def viewport(height: int) -> None:
        # Set through DevTools: the window's size would include its frame.
        metrics = {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False}
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)

    def save(name: str) -> None:
        # The page's whole height (within bounds), so the overview's tables show below
        # its charts; measured at the smallest height, as a taller viewport stretches it.
        viewport(HEIGHT)
        tall = browser.execute_script("return document.documentElement.scrollHeight")
        viewport(min(max(int(tall), HEIGHT), TALLEST))
        path = out / f"{name}.png"
        if not browser.save_screenshot(str(path)):
            raise RuntimeError(f"no screenshot of {name}")
        written.append(path)

    browser.get(base + "/")
    save("login")
    browser.find_element(By.NAME, "operator").send_keys("ops-anna")
    browser.find_element(By.NAME, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    browser.find_element(By.ID, "task-counts")
    save("overview")
    browser.get(base + "/dead")
    browser.find_element(By.NAME, "destination").send_keys("billing")
    browser.find_element(By.NAME, "error").send_keys("409")
    browser.find_element(By.CSS_SELECTOR, "#filters button").click()
    browser.find_element(By.ID, "dead")
    save("dead")
    # A bulk decision's first step: the count and the confirmation it asks for (nothing
    # is decided: the screenshot's run stops there).
    browser.find_element(By.CSS_SELECTOR, "#bulk-form input[name='reason']").send_keys(
        "billing settled the conflicts by hand"
    )
    browser.find_element(By.CSS_SELECTOR, "#bulk-form input[value='resolve']").click()
    browser.find_element(By.CSS_SELECTOR, "#bulk-form button").click()
    browser.find_element(By.ID, "bulk-confirm")
    save("bulk")
    browser.get(base + "/replies?state=sent")
    browser.find_element(By.ID, "list-filters")
    save("replies")
    browser.get(base + "/tasks?state=done")
    browser.find_element(By.ID, "list-filters")
    save("tasks")
    browser.get(base + "/reply?" + urlencode({"id": seeded.dead_requeued}))
    browser.find_element(By.ID, "decisions")
    save("reply")
    browser.get(base + "/task?" + urlencode({"id": seeded.failed_task}))
    browser.find_element(By.ID, "task-id")
    save("task")
    browser.find_element(By.NAME, "q").send_keys(seeded.sent_reply)
    browser.find_element(By.CSS_SELECTOR, "form.search button").click()
    browser.find_element(By.ID, "state")
    save("search")
    browser.get(base + "/audit")
    browser.find_element(By.ID, "audit")
    save("audit")
    return written


def main(argv: list[str] | None = None) -> int:
    """Seed, start the console, write the screenshots."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.console_screenshots")
    parser.add_argument("--db", help="an empty database URL (default: a new SQLite file)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "assets" / "console"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url = args.db or f"sqlite:///{Path(tmp) / 'outbox.db'}"
        outbox.upgrade(url)
        log(f"seeding {url}")
        seeded = seed(url)
        with console_process(url, Path(tmp) / "console.log", TOKEN) as base, chromium() as browser:
            for path in shoot(browser, base, seeded, out):
                log(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
