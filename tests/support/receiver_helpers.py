"""Shared helpers for the receiver tests: signing requests, counting rows, child receivers."""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pymysql
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox.receiver_tables import effects, receipts
from outbox.signing import sign
from receiver.effects import REPLY_ID_KEY, record_effect
from support.processes import PROCESS_EXIT, PROCESS_START, reap

SECRET = "whsec_" + base64.b64encode(b"receiver-test-secret-one-32bytes").decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"receiver-test-secret-two-32bytes").decode()
ROOT = Path(__file__).resolve().parents[2]


def signed(
    reply_id: str,
    body: bytes,
    secret: str | list[str] = SECRET,
    timestamp: float | None = None,
    content_type: str | None = "application/json",
) -> dict[str, str]:
    """Headers of a correctly signed request (plus a Content-Type unless None)."""
    headers = sign(secret, reply_id, timestamp, body)
    if content_type is not None:
        headers["content-type"] = content_type
    return headers


def count_effects(url: str, reply_id: str | None = None) -> int:
    """Rows in receiver_effects (for one reply_id when given)."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(effects)
            if reply_id is not None:
                query = query.where(effects.c.reply_id == reply_id)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def stored_receipts(url: str) -> dict[str, bytes]:
    """reply_id -> stored body of every receipt."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(receipts.c.reply_id, receipts.c.body)).all()
            return {row.reply_id: bytes(row.body) for row in rows}
    finally:
        engine.dispose()


@contextmanager
def effects_refused(url: str, reply_ids: Sequence[str]) -> Iterator[Callable[[], None]]:
    """While open, the database refuses the receiver_effects row of each of `reply_ids` (a
    trigger), so the reference effect fails for those alone, even where it rides on the
    receipt insert; call what it yields to let them through again."""
    engine = outbox.create_engine(url)
    dialect = engine.dialect.name
    refused = "EXISTS (SELECT 1 FROM refused_effects WHERE reply_id = NEW.reply_id)"
    trigger = "CREATE TRIGGER refuse_effect BEFORE INSERT ON receiver_effects "
    create = {
        "postgresql": [
            "CREATE FUNCTION refuse_effect() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF {refused} THEN RAISE EXCEPTION 'effect refused'; END IF; RETURN NEW; END $$",
            f"{trigger}FOR EACH ROW EXECUTE FUNCTION refuse_effect()",
        ],
        "mysql": [
            f"{trigger}FOR EACH ROW BEGIN IF {refused} THEN "
            "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'effect refused'; END IF; END",
        ],
        "sqlite": [f"{trigger}WHEN {refused} BEGIN SELECT RAISE(ABORT, 'effect refused'); END"],
    }[dialect]
    drop = {
        "postgresql": [
            "DROP TRIGGER refuse_effect ON receiver_effects",
            "DROP FUNCTION refuse_effect()",
        ],
        "mysql": ["DROP TRIGGER refuse_effect"],
        "sqlite": ["DROP TRIGGER refuse_effect"],
    }[dialect] + ["DROP TABLE refused_effects"]

    def let_through() -> None:
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM refused_effects"))

    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("CREATE TABLE refused_effects (reply_id varchar(200) PRIMARY KEY)")
            )
            for reply_id in reply_ids:
                conn.execute(sa.text("INSERT INTO refused_effects VALUES (:r)"), {"r": reply_id})
            for statement in create:
                conn.execute(sa.text(statement))
        yield let_through
    finally:
        with engine.begin() as conn:
            for statement in drop:
                conn.execute(sa.text(statement))
        engine.dispose()


class InOrder:
    """The reference effect, refusing the reply_ids in `failing` (a set the test may change
    meanwhile) and noting in `out_of_order` each message `<key><n>` applied while
    `<key><n-1>` was not, neither committed nor earlier in its own transaction."""

    def __init__(self, *failing: str) -> None:
        self.failing = set(failing)
        self.out_of_order: list[str] = []

    def __call__(self, session: Session, body: bytes) -> None:
        reply_id = session.info[REPLY_ID_KEY]
        if reply_id in self.failing:
            raise RuntimeError(f"{reply_id} cannot be applied yet")
        key = reply_id.rstrip("0123456789")
        number = int(reply_id[len(key) :])
        if number > 1:
            before = sa.select(sa.func.count()).where(effects.c.reply_id == f"{key}{number - 1}")
            if not session.execute(before).scalar_one():
                self.out_of_order.append(reply_id)
        record_effect(session, body)


class AppClient:
    """A blocking client that calls an ASGI app in-process through httpx.ASGITransport."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __enter__(self) -> AppClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def request(
        self,
        method: str,
        path: str,
        content: bytes | Iterator[bytes] | None = None,
        headers: dict[str, str] | list[tuple[str, str]] | None = None,
    ) -> httpx.Response:
        """One request; an iterator body is sent chunk by chunk (chunked transfer)."""

        async def chunks(source: Iterator[bytes]) -> AsyncIterator[bytes]:
            for chunk in source:
                yield chunk

        async def go() -> httpx.Response:
            body: Any = content
            if content is not None and not isinstance(content, bytes):
                body = chunks(content)
            # Errors become 500 responses, so a crash is seen as the status it would be.
            transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as c:
                return await c.request(method, path, content=body, headers=headers)

        return asyncio.run(go())

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        """POST through the app."""
        return self.request("POST", path, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        """GET through the app."""
        return self.request("GET", path, **kwargs)


PORTS_PER_WORKER = 400
FIRST_PORT = 20_000
"""Below the kernel's ephemeral range (32768 and up), where every server bound to port 0
lands: a port this run hands out is never one another test's server was just given."""


def _worker_ports() -> range:
    """This xdist worker's own block of ports (gw0 the first; a run without xdist too)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = FIRST_PORT + (int(worker) if worker.isdigit() else 0) * PORTS_PER_WORKER
    return range(start, start + PORTS_PER_WORKER)


_handed_out = itertools.count()


def free_port() -> int:
    """A loopback port nobody listens on right now, from this worker's own block, in turn:
    a port found free among the ephemeral ones could be another worker's server's (bound
    to port 0) by the time a child process binds it, and a health check would then answer
    from that server."""
    ports = _worker_ports()
    for _ in ports:
        port = ports[next(_handed_out) % len(ports)]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use: another run's, or a test's still running
                continue
        return port
    raise RuntimeError(f"no free port in {ports}")


@contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses every connection while the block runs: bound, never
    listening, so no other test's server can take it (a port merely free when asked may
    be another xdist worker's server by the time a relay posts to it)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    """Poll `predicate` until true or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class ReceiverProcess:
    """`outbox receiver` running as a real child process on a free loopback port."""

    def __init__(
        self,
        db_url: str,
        secret_file: Path,
        env: dict[str, str] | None = None,
        options: Sequence[str] = (),
        port: int | None = None,
    ) -> None:
        """Start it on `port` (a free one by default: another on the same port is the same
        receiver back after a stop)."""
        self.port = free_port() if port is None else port
        self.base = f"http://127.0.0.1:{self.port}"
        child_env = {**os.environ, **(env or {})}
        child_env.pop("OUTBOX_RECEIVER_SECRETS", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "outbox_cli",
                "receiver",
                "--db",
                db_url,
                "--port",
                str(self.port),
                "--secret-file",
                str(secret_file),
                *options,
            ],
            cwd=ROOT,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def ready(self) -> bool:
        """Whether GET /healthz answers 200; fails at once if the process died."""
        if self.proc.poll() is not None:
            _, err = self.proc.communicate()
            raise AssertionError(f"receiver exited with {self.proc.returncode}: {err.decode()}")
        try:
            return httpx.get(self.base + "/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = PROCESS_START) -> ReceiverProcess:
        """Block until the receiver answers its health check; reaped if it never does."""
        try:
            wait_until(self.ready, timeout, "the receiver to become healthy")
        except BaseException:
            reap(self.proc)
            raise
        return self

    def stop(self) -> int:
        """Terminate (SIGTERM) and reap the process; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.communicate(timeout=PROCESS_EXIT)
        except subprocess.TimeoutExpired:
            reap(self.proc)
        return self.proc.returncode


def accept_in_child(url: str, reply_id: str, body: bytes, barrier: Any, results: Any) -> None:
    """Child-process body for the concurrency test: open a store, wait for all, accept once."""
    from receiver import ReceiptStore

    try:
        store = ReceiptStore(url)
    except Exception as exc:
        barrier.abort()
        results.put(f"error: {exc!r}")
        return
    try:
        barrier.wait(timeout=60)
        receipt = store.accept(reply_id, body, record_effect)
        results.put("duplicate" if receipt.duplicate else "stored")
    except Exception as exc:
        results.put(f"error: {exc!r}")
    finally:
        store.close()


def refused_connection(backend: str) -> Exception:
    """What `backend`'s DBAPI raises when its server or file cannot be reached."""
    if backend == "sqlite":
        return sqlite3.OperationalError("unable to open database file")
    if backend == "mysql":
        return pymysql.err.OperationalError(2003, "Can't connect to MySQL server")
    return psycopg.OperationalError("connection refused")


def relay_toml(directory: Path, destination: str, base: str, secret_file: Path) -> Path:
    """A relay config naming `destination` the receiver at `base`, with a receipt lookup."""
    config = directory / "relay.toml"
    config.write_text(
        f'[destinations.{destination}]\nurl = "{base}/replies"\n'
        f'secret_file = "{secret_file}"\nreceipt_lookup = true\n',
        encoding="utf-8",
    )
    return config
