"""outbox.asyncio.publish: the rules of publish() inside an AsyncSession or AsyncConnection
transaction, on every async driver; and the sync publish() on a Connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from support.relay_helpers import rows

import outbox
import outbox.asyncio
from outbox import InvalidMessage, PayloadCollision, SchemaNotReady


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """A sync engine on the test database, to read what was written."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


def async_urls(db_url: str) -> list[str]:
    """The test database through each async driver of its backend."""
    url = sa.make_url(db_url)
    if url.get_backend_name() == "sqlite":
        return [url.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False)]
    return [
        url.set(drivername=driver).render_as_string(hide_password=False)
        for driver in ("postgresql+asyncpg", "postgresql+psycopg")
    ]


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
