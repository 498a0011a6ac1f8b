"""The driver matrix of the caller's own session: the sync API on every sync driver, and the
relay's NOTIFY trigger firing for a publish committed through any driver.

The sync API (`outbox.publish` on a Session or a Connection, `TaskQueue.finish_tx`) runs
on the application's engine: psycopg 3, psycopg2 or sqlite3. The async API has its own
tests (test_async_publish.py). The NOTIFY part is PostgreSQL's: SQLite relays poll.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from support.async_urls import through
from support.receiver_helpers import refusing_port
from support.relay_helpers import rows

import outbox
import outbox.asyncio
from outbox import AuthContext, Claim, Envelope, Fenced, PayloadCollision, TaskQueue
from outbox.db.dialect import NOTIFY_CHANNEL
from receiver import ReceiptStore
from receiver.effects import record_effect
from relay import Relay, make_destination

# The longest a notification may take to arrive after its commit before the test fails.
DEADLINE = 10.0
# How long to listen for a notification that must not come (before the commit).
QUIET = 0.3


def sync_drivers(db_url: str) -> list[str]:
    """The sync drivers an application may use on the test database's backend."""
    return {
        "sqlite": ["sqlite"],
        "postgresql": ["postgresql+psycopg", "postgresql+psycopg2"],
        # The mysql extra's; the other DBAPIs are not in the development install.
        "mysql": ["mysql+pymysql"],
    }[sa.make_url(db_url).get_backend_name()]


def on(db_url: str, driver: str) -> str:
    """The test database's URL through `driver`."""
    return through(db_url, driver)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """The toolkit's own engine on the test database, to read what was written."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


def application_engines(db_url: str) -> Iterator[sa.Engine]:
    """An application's plain SQLAlchemy engine through each sync driver, disposed after use."""
    for driver in sync_drivers(db_url):
        app_engine = sa.create_engine(on(db_url, driver))
        try:
            assert app_engine.url.drivername == driver
            yield app_engine
        finally:
            app_engine.dispose()


def test_publish_on_every_sync_driver(db_url: str, engine: sa.Engine) -> None:
    kept = []
    for app_engine in application_engines(db_url):
        driver = app_engine.driver
        with Session(app_engine) as session:
            outbox.publish(session, "billing", f"gone-{driver}", {"n": 1})
            session.rollback()
        with Session(app_engine) as session, session.begin():
            row = outbox.publish(session, "billing", f"session-{driver}", {"n": 2})
            again = outbox.publish(session, "billing", f"session-{driver}", {"n": 2})
            assert again["id"] == row["id"]
            with pytest.raises(PayloadCollision):
                outbox.publish(session, "billing", f"session-{driver}", {"n": 3})
        with app_engine.begin() as conn:
            outbox.publish(conn, "billing", f"conn-{driver}", {"n": 4})
        kept += [f"session-{driver}", f"conn-{driver}"]
    stored = rows(engine)
    assert sorted(stored) == sorted(kept)
    assert all(row["state"] == "pending" for row in stored.values())


def test_finish_tx_on_every_sync_driver(db_url: str, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS test_driver_orders (id VARCHAR(64) PRIMARY KEY)")
        )
    drivers = []
    with TaskQueue(db_url, allowed_sources=("agent-a",), lease=30) as queue:

        def claimed(message_id: str) -> Claim:
            envelope = Envelope(message_id, "agent-a", {"m": message_id}, time.time() + 3600)
            queue.receive(AuthContext("agent-a"), envelope)
            claim = queue.claim("w")
            assert claim is not None
            return claim

        def finish(app_engine: sa.Engine, claim: Claim, order: str, keep: bool) -> None:
            with Session(app_engine) as session, session.begin():
                insert = sa.text("INSERT INTO test_driver_orders (id) VALUES (:id)")
                session.execute(insert, {"id": order})
                queue.finish_tx(session, claim, {"order": order})
                if not keep:
                    session.rollback()

        for app_engine in application_engines(db_url):
            driver = app_engine.driver
            drivers.append(driver)
            kept, dropped = claimed(f"kept-{driver}"), claimed(f"dropped-{driver}")
            finish(app_engine, kept, f"kept-{driver}", keep=True)
            finish(app_engine, dropped, f"dropped-{driver}", keep=False)
            assert (queue.task(kept.task_id) or {}).get("result") == {"order": f"kept-{driver}"}
            assert (queue.task(dropped.task_id) or {}).get("state") == "running"
            replies = {m["reply_id"] for m in queue.messages()}
            assert "reply:" + kept.task_id in replies
            assert "reply:" + dropped.task_id not in replies
            # The finished claim no longer holds: Fenced, and the caller's writes roll back.
            with pytest.raises(Fenced):
                finish(app_engine, kept, f"again-{driver}", keep=True)
            queue.fail(dropped, "done with this test", permanent=True)
    with engine.begin() as conn:
        orders = set(conn.execute(sa.text("SELECT id FROM test_driver_orders")).scalars())
        conn.execute(sa.text("DROP TABLE test_driver_orders"))
    assert orders == {f"kept-{driver}" for driver in drivers}


# --- NOTIFY ---------------------------------------------------------------------------


@pytest.fixture
def listener(db_url: str) -> Iterator[psycopg.Connection[object]]:
    """A connection LISTENing on the relay's channel, as a relay does."""
    conninfo = on(db_url, "postgresql")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        yield conn


def heard(listener: psycopg.Connection[object], timeout: float) -> list[str]:
    """The channels of the notifications that arrive within `timeout` (at the first one)."""
    return [note.channel for note in listener.notifies(timeout=timeout, stop_after=1)]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_publish_committed_through_a_sync_driver_notifies_the_relay(
    db_url: str, engine: sa.Engine, listener: psycopg.Connection[object], driver: str
) -> None:
    app_engine = sa.create_engine(on(db_url, f"postgresql+{driver}"))
    try:
        assert app_engine.driver == driver
        with Session(app_engine) as session, session.begin():
            outbox.publish(session, "billing", f"notify-{driver}", {"n": 1})
            assert heard(listener, QUIET) == [], "notified before the commit"
        assert heard(listener, DEADLINE) == [NOTIFY_CHANNEL]
    finally:
        app_engine.dispose()
    assert list(rows(engine)) == [f"notify-{driver}"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_a_publish_committed_through_an_async_driver_notifies_the_relay(
    db_url: str, engine: sa.Engine, listener: psycopg.Connection[object], driver: str
) -> None:
    async def scenario() -> None:
        async_engine = create_async_engine(on(db_url, f"postgresql+{driver}"))
        try:
            assert async_engine.driver == driver
            async with AsyncSession(async_engine) as session, session.begin():
                await outbox.asyncio.publish(session, "billing", f"notify-{driver}", {"n": 1})
                # Off the event loop: the session's driver may need it meanwhile.
                early = await asyncio.to_thread(heard, listener, QUIET)
                assert early == [], "notified before the commit"
            assert await asyncio.to_thread(heard, listener, DEADLINE) == [NOTIFY_CHANNEL]
        finally:
            await async_engine.dispose()

    asyncio.run(scenario())
    assert list(rows(engine)) == [f"notify-{driver}"]


# --- the toolkit's own engines ------------------------------------------------------------


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_toolkit_opens_any_postgresql_url_with_psycopg(db_url: str, engine: sa.Engine) -> None:
    # An application on psycopg2 hands its URL to the relay, the receiver and the commands
    # too; their SQL binds psycopg's binary arrays, which psycopg2 cannot.
    url = on(db_url, "postgresql+psycopg2")
    app_engine = sa.create_engine(url)
    try:
        with Session(app_engine) as session, session.begin():
            outbox.publish(session, "default", "from-psycopg2", {"n": 1})
    finally:
        app_engine.dispose()
    with ReceiptStore(url) as store, TaskQueue(url) as queue:
        assert {store.engine.driver, queue.engine.driver} == {"psycopg"}
        assert not store.accept("r-1", b'{"n":1}', record_effect).duplicate
    with refusing_port() as port:
        nobody = make_destination(f"http://127.0.0.1:{port}/replies", unsigned=True, timeout=2)
        with Relay(url, {"default": nobody}) as relay:
            assert relay.engine.driver == "psycopg"
            assert relay.dispatch_once() == [("from-psycopg2", "retry")]
    assert rows(engine)["from-psycopg2"]["attempts"] == 1
