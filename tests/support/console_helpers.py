"""Helpers for tests of `outbox console`: a seeded database and a client on the app."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox import AuthContext, Envelope, TaskQueue
from outbox.clock import Clock
from outbox.operations import Operations
from outbox.schema import messages
from outbox.testing import ManualClock
from outbox_cli.console.app import create_app
from outbox_cli.console.forms import CSRF_FIELD
from receiver import ReceiptStore
from support.processes import PROCESS_EXIT, PROCESS_START, reap
from support.receiver_helpers import ROOT, free_port, wait_until

SCRIPT_BODY = {"note": "<script>document.title='ran'</script>", "amp": "a & b"}
TOKEN = "s3cret-console-token-for-tests"
OPERATOR = "ops-anna"
"""The name the tests' operators log in with, or the console is started with."""
BOUND_HOST = "127.0.0.1"
BOUND_PORT = 8080
"""The address an in-process console app believes it is bound to."""
CSRF_INPUT = re.compile(rf'name="{CSRF_FIELD}" value="([^"]+)"')
CONFIRM_INPUT = re.compile(r'name="confirm" value="([^"]+)"')


def seed(db_url: str, engine: sa.Engine, clock: ManualClock) -> None:
    """Three tasks (one done, with its reply pending), and dead replies: two to billing
    (410 and 409), one to shipping (a body holding <script>), created an hour apart."""
    with TaskQueue(db_url, clock=clock, allowed_sources=("agent-a",)) as queue:
        for n in range(3):
            envelope = Envelope(f"m-{n}", "agent-a", {"n": n}, clock() + 3600)
            queue.receive(AuthContext("agent-a"), envelope)
        done = queue.claim("worker-1")
        assert done is not None
        queue.finish(done, {"ok": True})
    dead = [
        ("b-1", "billing", 410, "HTTP 410: gone", {"id": "b-1"}),
        ("b-2", "billing", 409, "HTTP 409 conflict: other body", {"id": "b-2"}),
        ("s-1", "shipping", None, "outcome unknown: <b>lease</b> expired", SCRIPT_BODY),
    ]
    for reply_id, destination, status, error, body in dead:
        with Session(engine) as session, session.begin():
            outbox.publish(session, destination, reply_id, body, clock=clock)
        with engine.begin() as conn:
            conn.execute(
                sa.update(messages)
                .where(messages.c.reply_id == reply_id)
                .values(state="dead", attempts=3, last_status=status, last_error=error)
            )
        clock.advance(3600)


class ConsoleClient:
    """A blocking client on the console app, in process, keeping cookies as a browser does
    (redirects are not followed, so a test sees them)."""

    def __init__(self, app: Any, base_url: str, peer: str = "127.0.0.1") -> None:
        self.app = app
        self._runner = asyncio.Runner()
        transport = httpx.ASGITransport(app=app, client=(peer, 50_000))
        self._client = httpx.AsyncClient(transport=transport, base_url=base_url)

    @property
    def cookies(self) -> httpx.Cookies:
        """The cookies the app has set."""
        return self._client.cookies

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request through the app."""
        return self._runner.run(self._client.request(method, path, **kwargs))

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        """GET through the app."""
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        """POST through the app."""
        return self.request("POST", path, **kwargs)

    def close(self) -> None:
        """Close the client and its event loop."""
        self._runner.run(self._client.aclose())
        self._runner.close()


def client(
    ops: Operations,
    *,
    token: str | None = None,
    read_only: bool = False,
    config: str | None = None,
    host: str = BOUND_HOST,
    scheme: str = "http",
    clock: Clock | None = None,
    app: Any = None,
    peer: str = "127.0.0.1",
    operator: str | None = None,
    reply_destination: str = "default",
) -> ConsoleClient:
    """A client on the console app over `ops` (or on `app`, another client's), as if bound
    to `host`:BOUND_PORT, its --operator `operator`; requests go to that address over
    `scheme`, from `peer`."""
    if app is None:
        app = create_app(
            ops,
            config=config,
            token=token,
            read_only=read_only,
            host=host,
            clock=clock,
            operator=operator,
            reply_destination=reply_destination,
        )
    shown = f"[{host}]" if ":" in host else host
    return ConsoleClient(app, f"{scheme}://{shown}:{BOUND_PORT}", peer)


def csrf_of(page: str) -> str:
    """The CSRF token a page's forms carry."""
    found = CSRF_INPUT.search(page)
    assert found is not None, "the page has no form with a CSRF token"
    return found[1]


def confirmation_of(page: str) -> str:
    """The force confirmation a refusal's page offers."""
    found = CONFIRM_INPUT.search(page)
    assert found is not None, "the page offers no force confirmation"
    return found[1]


def log_in(console: ConsoleClient, operator: str = OPERATOR, token: str = TOKEN) -> None:
    """Log in through the form as `operator`, with `token`."""
    found = CSRF_INPUT.search(console.get("/login").text)
    assert found is not None, "the login page has no CSRF token"
    form = {CSRF_FIELD: found[1], "operator": operator, "token": token, "next": "/"}
    assert console.post("/login", data=form).status_code == 303


class ConsoleProcess:
    """`outbox console` running as a real child process on a free loopback port."""

    def __init__(self, db_url: str, log: Path, *extra: str, token: str | None = None) -> None:
        self.db_url = db_url
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        if token is not None:
            env["OUTBOX_CONSOLE_TOKEN"] = token
        self.log = log
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "outbox_cli", "console", "--db", db_url,
                 "--port", str(self.port), *extra],
                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def ready(self) -> bool:
        """Whether the style sheet (open to all) answers; fails at once if the process died."""
        if self.proc.poll() is not None:
            raise AssertionError(
                f"console exited with {self.proc.returncode}: {self.log.read_text()}"
            )
        try:
            return httpx.get(self.base + "/static/console.css", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = PROCESS_START) -> ConsoleProcess:
        """Block until the console answers; reaped if it never does."""
        try:
            wait_until(self.ready, timeout, "the console to answer")
        except BaseException:
            reap(self.proc)
            raise
        return self

    def stop(self) -> int:
        """Terminate (SIGTERM) and reap the process; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=PROCESS_EXIT)
        except subprocess.TimeoutExpired:
            reap(self.proc)
        return self.proc.returncode


def hold_receipt(db_url: str, engine: sa.Engine, reply_id: str) -> None:
    """The receiver at `db_url` holds message `reply_id`'s exact body, as if only its ACK
    was lost: the receipt lookup answers "received"."""
    with engine.connect() as conn:
        body = conn.execute(
            sa.select(messages.c.body).where(messages.c.reply_id == reply_id)
        ).scalar_one()
    with ReceiptStore(db_url) as store:
        store.accept(reply_id, bytes(body))
