"""outbox.asyncio: the rules of publish(), receive_tx() and finish_tx() inside an AsyncSession
or AsyncConnection transaction, on every async driver; and the sync publish() on a Connection."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from support.async_urls import async_urls
from support.relay_helpers import rows

import outbox
import outbox.asyncio
from outbox import (
    Ack,
    AuthContext,
    Claim,
    Envelope,
    Fenced,
    InvalidEnvelope,
    InvalidMessage,
    PayloadCollision,
    SchemaNotReady,
    TaskQueue,
    Unauthorized,
)
from outbox.db.dialect import make_url as outbox_make_url
from outbox_cli import main


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """A sync engine on the test database, to read what was written."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


def on_each_driver(db_url: str, scenario: Callable[[Any], Awaitable[None]]) -> None:
    """Run `scenario(async_engine)` once per async driver of the backend."""

    async def run(url: str) -> None:
        engine = create_async_engine(url)
        try:
            await scenario(engine)
        finally:
            await engine.dispose()

    for url in async_urls(db_url):
        asyncio.run(run(url))


def test_it_joins_the_callers_transaction_and_never_commits(db_url: str, engine: sa.Engine) -> None:
    async def scenario(async_engine: Any) -> None:
        driver = async_engine.url.drivername
        async with AsyncSession(async_engine) as session:
            async with session.begin():
                await outbox.asyncio.publish(session, "billing", f"gone-{driver}", {"n": 1})
                await session.rollback()
            async with session.begin():
                row = await outbox.asyncio.publish(session, "billing", f"kept-{driver}", {"n": 2})
                assert row["reply_id"] == f"kept-{driver}"
        async with async_engine.connect() as conn:
            await outbox.asyncio.publish(conn, "billing", f"conn-{driver}", {"n": 3})
            await conn.commit()

    on_each_driver(db_url, scenario)
    stored = rows(engine)
    drivers = [sa.make_url(url).drivername for url in async_urls(db_url)]
    assert sorted(stored) == sorted([f"kept-{d}" for d in drivers] + [f"conn-{d}" for d in drivers])
    assert all(row["state"] == "pending" for row in stored.values())


def test_the_same_rules_as_publish(db_url: str, engine: sa.Engine) -> None:
    async def scenario(async_engine: Any) -> None:
        async with AsyncSession(async_engine) as session, session.begin():
            first = await outbox.asyncio.publish(session, "billing", "same", {"a": 1})
            again = await outbox.asyncio.publish(session, "billing", "same", {"a": 1})
            assert again["id"] == first["id"]
            with pytest.raises(PayloadCollision):
                await outbox.asyncio.publish(session, "billing", "same", {"a": 2})
            with pytest.raises(InvalidMessage):
                await outbox.asyncio.publish(session, "billing", "bad.id", {"a": 1})
            with pytest.raises(InvalidMessage):
                await outbox.asyncio.publish(session, "billing", "x", {"a": float("nan")})
        async with async_engine.begin() as conn:
            await conn.execute(sa.text("DELETE FROM outbox_messages"))

    on_each_driver(db_url, scenario)
    assert rows(engine) == {}


def test_the_wrong_flavour_of_session_names_the_right_function(
    db_url: str, engine: sa.Engine
) -> None:
    with Session(engine) as session, pytest.raises(TypeError, match=r"outbox\.publish"):
        asyncio.run(outbox.asyncio.publish(session, "billing", "x", {}))  # type: ignore[arg-type]

    async def scenario(async_engine: Any) -> None:
        async with AsyncSession(async_engine) as session:
            with pytest.raises(TypeError, match=r"await outbox\.asyncio\.publish"):
                outbox.publish(session, "billing", "x", {})

    on_each_driver(db_url, scenario)


def test_sync_publish_takes_a_connection(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        outbox.publish(conn, "billing", "via-connection", {"n": 1})
    assert list(rows(engine)) == ["via-connection"]


def test_a_database_without_the_schema_names_the_command(tmp_path: Path) -> None:
    async def scenario() -> None:
        async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'blank.db'}")
        try:
            async with AsyncSession(async_engine) as session, session.begin():
                with pytest.raises(SchemaNotReady, match="outbox db upgrade"):
                    await outbox.asyncio.publish(session, "billing", "x", {})
        finally:
            await async_engine.dispose()

    asyncio.run(scenario())


def test_finish_tx_commits_result_reply_and_own_writes_together_and_is_fenced(
    db_url: str, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS test_async_orders (id VARCHAR(64) PRIMARY KEY)")
        )
    with TaskQueue(db_url, allowed_sources=("agent-a",), lease=30) as queue:

        def claimed(message_id: str) -> Claim:
            envelope = Envelope(message_id, "agent-a", {"m": message_id}, time.time() + 3600)
            queue.receive(AuthContext("agent-a"), envelope)
            claim = queue.claim("w")
            assert claim is not None
            return claim

        async def finish(async_engine: Any, claim: Claim, order: str, keep: bool) -> None:
            async with AsyncSession(async_engine) as session, session.begin():
                insert = sa.text("INSERT INTO test_async_orders (id) VALUES (:id)")
                await session.execute(insert, {"id": order})
                await outbox.asyncio.finish_tx(queue, session, claim, {"order": order})
                if not keep:
                    await session.rollback()

        async def scenario(async_engine: Any) -> None:
            driver = async_engine.url.drivername
            kept, dropped = claimed(f"kept-{driver}"), claimed(f"dropped-{driver}")
            await finish(async_engine, kept, f"kept-{driver}", keep=True)
            await finish(async_engine, dropped, f"dropped-{driver}", keep=False)
            assert (queue.task(kept.task_id) or {}).get("result") == {"order": f"kept-{driver}"}
            assert (queue.task(dropped.task_id) or {}).get("state") == "running"
            replies = {m["reply_id"] for m in queue.messages()}
            assert "reply:" + kept.task_id in replies
            assert "reply:" + dropped.task_id not in replies
            # The finished claim no longer holds: Fenced, and the caller's writes roll back.
            with pytest.raises(Fenced):
                await finish(async_engine, kept, f"again-{driver}", keep=True)
            queue.fail(dropped, "done with this test", permanent=True)

        on_each_driver(db_url, scenario)
    with engine.connect() as conn:
        orders = set(conn.execute(sa.text("SELECT id FROM test_async_orders")).scalars())
    drivers = [sa.make_url(url).drivername for url in async_urls(db_url)]
    assert {o for o in orders if o.split("-", 1)[1] in drivers} == {f"kept-{d}" for d in drivers}


def test_finish_tx_refuses_a_sync_session(db_url: str, engine: sa.Engine) -> None:
    with TaskQueue(db_url) as queue, Session(engine) as session:
        claim = Claim("t", "w", 1, 1, {})
        with pytest.raises(TypeError, match=r"queue\.finish_tx\(session, claim, result\)"):
            asyncio.run(outbox.asyncio.finish_tx(queue, session, claim, 1))  # type: ignore[arg-type]


def test_the_sync_finish_tx_refuses_an_async_session(db_url: str) -> None:
    async def scenario(async_engine: Any) -> None:
        with TaskQueue(db_url) as queue:
            async with AsyncSession(async_engine) as session:
                claim = Claim("t", "w", 1, 1, {})
                with pytest.raises(TypeError, match=r"await outbox\.asyncio\.finish_tx"):
                    queue.finish_tx(session, claim, 1)  # type: ignore[arg-type]

    on_each_driver(db_url, scenario)


def inbox_and_tasks(engine: sa.Engine) -> list[tuple[str, str]]:
    """(message_id, task state) of every stored task."""
    query = sa.text(
        "SELECT i.message_id, t.state FROM outbox_inbox i JOIN outbox_tasks t USING (task_id)"
    )
    with engine.connect() as conn:
        return sorted((row.message_id, row.state) for row in conn.execute(query))


def test_receive_tx_stores_the_task_with_the_callers_commit_only(
    db_url: str, engine: sa.Engine
) -> None:
    source = AuthContext("agent-a")
    deadline = time.time() + 3600  # one deadline: it is part of the content

    def task(message_id: str, n: Any = 1) -> Envelope:
        return Envelope(message_id, "agent-a", {"n": n}, deadline)

    with TaskQueue(db_url, allowed_sources=("agent-a",)) as queue:

        async def scenario(async_engine: Any) -> None:
            driver = async_engine.url.drivername
            async with AsyncSession(async_engine) as session:
                async with session.begin():
                    await outbox.asyncio.receive_tx(queue, session, source, task(f"gone-{driver}"))
                    await outbox.asyncio.publish(session, "billing", f"gone-{driver}", {})
                    await session.rollback()
                async with session.begin():
                    ack = await outbox.asyncio.receive_tx(
                        queue, session, source, task(f"kept-{driver}")
                    )
                    await outbox.asyncio.publish(session, "billing", f"kept-{driver}", {})
                    again = await outbox.asyncio.receive_tx(
                        queue, session, source, task(f"kept-{driver}")
                    )
                    assert (ack.duplicate, again) == (False, Ack(ack.task_id, duplicate=True))
                    with pytest.raises(PayloadCollision):
                        await outbox.asyncio.receive_tx(
                            queue, session, source, task(f"kept-{driver}", n=2)
                        )
                    with pytest.raises(InvalidEnvelope):
                        await outbox.asyncio.receive_tx(
                            queue,
                            session,
                            source,
                            task(f"bad-{driver}", n=float("nan")),  # type: ignore[arg-type]
                        )
                    with pytest.raises(Unauthorized):
                        await outbox.asyncio.receive_tx(
                            queue, session, AuthContext("intruder"), task(f"bad-{driver}")
                        )
            async with async_engine.connect() as conn:
                await outbox.asyncio.receive_tx(queue, conn, source, task(f"conn-{driver}"))
                await conn.commit()
            # Stored by the caller's commit exactly as receive() would: a duplicate now.
            assert queue.receive(source, task(f"kept-{driver}")).duplicate

        on_each_driver(db_url, scenario)
    drivers = [sa.make_url(url).drivername for url in async_urls(db_url)]
    expected = [(f"{kind}-{d}", "pending") for d in drivers for kind in ("conn", "kept")]
    assert inbox_and_tasks(engine) == sorted(expected)
    assert sorted(rows(engine)) == sorted(f"kept-{d}" for d in drivers)


def test_receive_tx_refuses_the_wrong_flavour_of_session(db_url: str, engine: sa.Engine) -> None:
    envelope = Envelope("m", "agent-a", {}, time.time() + 3600)
    with TaskQueue(db_url, allowed_sources=("agent-a",)) as queue:
        with Session(engine) as session:
            call = outbox.asyncio.receive_tx(queue, session, AuthContext("agent-a"), envelope)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"queue\.receive_tx\(session, auth, envelope\)"):
                asyncio.run(call)

        async def scenario(async_engine: Any) -> None:
            async with AsyncSession(async_engine) as session:
                with pytest.raises(TypeError, match=r"await outbox\.asyncio\.receive_tx"):
                    queue.receive_tx(session, AuthContext("agent-a"), envelope)  # type: ignore[arg-type]

        on_each_driver(db_url, scenario)
    assert inbox_and_tasks(engine) == []


def test_commands_and_upgrade_take_an_async_url(
    db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blank = f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
    outbox.upgrade(blank)  # migrations run on the sync driver of the same database
    for url in [*async_urls(db_url), blank]:
        assert main(["status", "--db", url, "--json"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["messages"] is not None


def test_asyncpg_url_options_are_given_their_libpq_names(db_url: str) -> None:
    url = outbox_make_url(
        "postgresql+asyncpg://u@h/db?ssl=disable&prepared_statement_cache_size=0&application_name=a"
    )
    assert url.drivername == "postgresql+psycopg"
    assert dict(url.query) == {"sslmode": "disable", "application_name": "a"}
    assert outbox_make_url("postgresql+asyncpg://u@h/db?ssl=true").query["sslmode"] == "verify-full"
    if sa.make_url(db_url).get_backend_name() == "postgresql":
        pgbouncer_style = sa.make_url(db_url).set(
            drivername="postgresql+asyncpg",
            query={"ssl": "disable", "prepared_statement_cache_size": "0"},
        )
        with TaskQueue(pgbouncer_style.render_as_string(hide_password=False)) as queue:
            assert queue.ping()


def test_a_closed_connection_is_refused_and_a_committed_session_needs_a_new_commit(
    db_url: str, engine: sa.Engine
) -> None:
    async def scenario(async_engine: Any) -> None:
        driver = async_engine.url.drivername
        conn = await async_engine.connect()
        await conn.close()
        with pytest.raises(sa.exc.ResourceClosedError):
            await outbox.asyncio.publish(conn, "billing", f"closed-{driver}", {"n": 1})
        async with AsyncSession(async_engine) as session:
            async with session.begin():
                await outbox.asyncio.publish(session, "billing", f"first-{driver}", {"n": 1})
            # SQLAlchemy begins a new transaction: the message is the caller's to commit.
            await outbox.asyncio.publish(session, "billing", f"after-{driver}", {"n": 2})
            assert session.in_transaction()
            await session.rollback()

    on_each_driver(db_url, scenario)
    assert all(reply_id.startswith("first-") for reply_id in rows(engine))
    assert len(rows(engine)) == len(async_urls(db_url))
